"""The distill stage's KL with the LM head applied a chunk of positions at a time (``distill.logit_chunk``).

Whole, a micro-batch's KL holds (rows, length, vocab) float32 logits for the teacher and the student,
the teacher's probabilities and the logits' gradient: at 2,048 tokens and a 128K vocabulary several
GB per row. Chunked, the model bodies run once; then for each chunk of positions the teacher's
logits (no gradient) or its top-k targets, the student's logits and the chunk's KL are computed and
the chunk's backward runs at once, down to a detached copy of the student's final hidden states, whose
gradient gathers over the chunks; one backward through the body ends it. Only one chunk's logits
are alive at a time, nothing is recomputed, and the gradient is the whole KL's (float rounding
aside; ``tests/component/test_distill.py`` compares them).

The head is the model's output embedding after its body's final hidden states (``base_model_prefix``),
with the known post-processing of Hugging Face heads (Gemma's final soft-cap, Cohere's
``logit_scale``, Granite's ``logits_scaling``); :func:`check_head` compares it with the model's own
logits once per stage and refuses a model whose head does something else.
"""
from __future__ import annotations

import torch

from dofla.errors import DoflaError
from dofla.precision import autocast


def body_and_head(model):
    """(body, head): ``body(input_ids)`` -> the final hidden states (B, L, D), ``head(hidden)`` -> logits,
    for a Hugging Face causal LM (or the peft wrapper of one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, embed, config = getattr(base, base.base_model_prefix), base.get_output_embeddings(), base.config
    scale, divide = getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = embed(hidden)
        if scale:
            logits = logits * scale
        if divide:
            logits = logits / divide
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return (lambda ids: body(input_ids=ids, use_cache=False).last_hidden_state), head


@torch.no_grad()
def check_head(model, ids: torch.Tensor) -> None:
    """Refuse a model whose logits :func:`body_and_head` does not reproduce (on ``ids``' first row)."""
    body, head = body_and_head(model)
    row = ids[:1, :16]
    expected = model(input_ids=row, use_cache=False).logits.float()
    got = head(body(row)).float()
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()):
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise DoflaError(f"distill.logit_chunk: dofla cannot reproduce the LM head of model type {kind!r} "
                         f"(largest difference {(got - expected).abs().max().item():.3g}); set distill.logit_chunk=0")


def chunked_kl_backward(model, ids: torch.Tensor, targets, chunk: int, temperature: float, precision: str,
                        weight: float = 1.0) -> torch.Tensor:
    """The mean KL(teacher ‖ student) over ``ids``' tokens (returned detached) with ``weight`` × its
    gradient accumulated into the student's parameters, the logits a ``chunk`` of positions at a time.
    ``targets``: the teacher's (:mod:`dofla.train.kl_targets`), whose ``part(positions)`` gives a chunk's."""
    body, head = body_and_head(model)
    with autocast(precision, ids.device):
        hidden = body(ids)
    detached = hidden.detach().requires_grad_(True)
    total = torch.zeros((), device=ids.device)
    length = ids.shape[1]
    for start in range(0, length, chunk):
        part = slice(start, min(start + chunk, length))
        with torch.no_grad(), autocast(precision, ids.device):
            target = targets.part(part)
        with autocast(precision, ids.device):
            logits = head(detached[:, part])
        share = (part.stop - part.start) / length  # the chunk's tokens over the micro-batch's
        loss = target.kl(logits, temperature) * share
        (loss * weight).backward()
        total += loss.detach()
    hidden.backward(detached.grad)
    return total
