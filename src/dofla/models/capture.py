"""Capture each layer's post-RoPE queries, keys and values during a teacher forward pass.

The teacher runs with a capturing attention function registered under ``dofla_capture``: it hands
q (scaled so the kernel is exp(q·k/sqrt(d)), whatever scaling the module passes, e.g. Gemma's
``query_pre_attn_scalar``), k and v of every layer to a callback, then computes the teacher's own
attention so the forward pass is exactly the teacher's. transformers builds the same masks for
``dofla_capture`` as for SDPA, so sliding windows and padding reach it; soft-capped logits
(Gemma 2, which SDPA cannot do) go through :func:`softcapped_attention`.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from dofla.models.adapters.support import get_adapter

CAPTURE_IMPLEMENTATION = "dofla_capture"

# (layer_idx, q (B, H, T, d), k (B, H_kv, T, d), v (B, H_kv, T, d)) -> None
CaptureCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Softmax attention over logits c·tanh(scaling·q·k / c); returns (B, T, H, d).

    q (B, H, T, d), k and v (B, H_kv, S, d); ``attention_mask`` is a boolean (True = attend) or
    additive (B or 1, 1, T, S) mask, or None for causal attention aligned to the last key.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        t, s = scores.shape[-2:]
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(diagonal=s - t)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous()


def _capture_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    module.dofla_capture_callback(module.layer_idx, query * (scaling * math.sqrt(query.shape[-1])), key, value)
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return softcapped_attention(query, key, value, attention_mask, scaling, softcap), None


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_IMPLEMENTATION, sdpa_mask)


@contextmanager
def capturing(model, attention_modules, callback: CaptureCallback):
    """Within the block, every forward of ``model`` reports each layer's q, k, v to ``callback``."""
    previous = model.config._attn_implementation
    for module in attention_modules:
        module.dofla_capture_callback = callback
    model.config._attn_implementation = CAPTURE_IMPLEMENTATION
    try:
        yield
    finally:
        model.config._attn_implementation = previous
        for module in attention_modules:
            del module.dofla_capture_callback


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run the teacher on ``input_ids`` (B, T) and return [(q, k, v)] per layer (see module doc)."""
    captured: dict[int, tuple] = {}
    modules = get_adapter(model).attention_modules(model)
    with capturing(model, modules, lambda i, q, k, v: captured.__setitem__(i, (q, k, v))):
        model(input_ids=input_ids, use_cache=False)
    return [captured[i] for i in range(len(modules))]
