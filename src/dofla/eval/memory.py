"""Decode memory per sequence: the bytes a model's cache holds while it generates, at a context length.

A student's cache (:class:`~dofla.models.recurrent_cache.RecurrentStateCache`) holds a fixed-size state
per linear, gated-delta, hybrid or sliding-window layer and every key and value of a layer kept exact; a
teacher's Hugging Face cache holds every key and value. Once every window is full, the bytes are affine in
the tokens seen, so they are measured after two short prefills and extended to any context: exact, and
no 8K-token forward is needed to know what 8K tokens cost.
"""
from __future__ import annotations

import torch

PROBE = 16  # tokens between the two measured prefills


def cache_bytes(cache) -> int:
    """Bytes of the tensors a decode cache holds (a student's states, or a teacher's keys and values)."""
    if hasattr(cache, "state_bytes"):
        return int(cache.state_bytes())
    tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def widest_window(model) -> int:
    """The most tokens any layer keeps before its cache stops growing (window + sinks; 0 when none)."""
    attentions = model.student_attentions() if hasattr(model, "student_attentions") else []
    spans = [a.window + a.sinks for a in attentions]
    teacher_window = getattr(model.config, "sliding_window", None) or 0
    return max([0, teacher_window, *spans])


@torch.no_grad()
def prefill_bytes(model, tokens: int) -> int:
    """The cache's bytes after one forward over ``tokens`` tokens of one sequence."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids.to(device), use_cache=True)
    return cache_bytes(out.past_key_values)


def decode_bytes(model, contexts: list[int]) -> dict[int, int]:
    """Per context length, the bytes of one sequence's decode cache after that many tokens."""
    first = widest_window(model) + PROBE
    low, high = prefill_bytes(model, first), prefill_bytes(model, first + PROBE)
    per_token = (high - low) / PROBE
    return {context: int(round(low + per_token * (context - first))) if context >= first
            else prefill_bytes(model, context) for context in contexts}


def memory_metrics(who: str, model, contexts: list[int]) -> dict:
    """``memory/<who>/decode_mib/T<context>``: MiB of one sequence's decode cache at each context."""
    return {f"memory/{who}/decode_mib/T{context}": b / 2**20 for context, b in decode_bytes(model, contexts).items()}
