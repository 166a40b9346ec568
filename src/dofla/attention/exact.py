"""Exact softmax attention that keeps its own keys and values: the exact heads of a layer whose other heads
take other forms (:class:`~dofla.models.mixed_attention.MixedAttention`). A layer exact in every head keeps
its keys and values in the teacher's own cache layer instead (:mod:`dofla.models.recurrent_cache`).

The state holds the key/value heads unexpanded (B, H_kv, S, d), as the teacher's cache does, and the
padding of the positions it holds (None while nothing was padded). Queries are the last T of the S
positions. Layouts: q (B, H, T, d) scaled so the kernel is exp(q·k/√d); k, v (B, H_kv, T, d).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dofla.attention.sliding import _masked_softmax_apply


@dataclass
class ExactState:
    """Every key and value seen (B, H_kv, S, d) and which positions are real (B, S); None: all of them."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def index_select(self, index: torch.Tensor) -> "ExactState":
        pick = lambda t: None if t is None else t.index_select(0, index.to(t.device))  # noqa: E731
        return ExactState(pick(self.k), pick(self.v), pick(self.valid))

    def nbytes(self) -> int:
        kept = [t for t in (self.k, self.v, self.valid) if t is not None]
        return sum(t.numel() * t.element_size() for t in kept)


def _joined_valid(state: ExactState | None, key_valid, batch: int, new: int, device):
    held = 0 if state is None else state.length
    if key_valid is None and (state is None or state.valid is None):
        return None
    old = torch.ones(batch, held, dtype=torch.bool, device=device) if state is None or state.valid is None \
        else state.valid
    now = torch.ones(batch, new, dtype=torch.bool, device=device) if key_valid is None else key_valid.bool()
    return torch.cat([old, now], dim=1)


def exact_attention(q, k, v, state: ExactState | None = None, key_valid=None, softcap: float | None = None):
    """Causal softmax of the T new queries over every key held and new; returns (out, the new state)."""
    b, h, t, d = q.shape
    valid = _joined_valid(state, key_valid, b, t, q.device)
    if state is not None:
        k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
    new_state = ExactState(k, v, valid)
    group, s = h // k.shape[1], k.shape[2]
    keys, values = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    if valid is None and softcap is None:  # the fused kernel: no T×S scores kept
        mask = None if t == s or t == 1 else _causal(t, s, q.device)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                             is_causal=t == s and t > 1)
        return out.to(v.dtype), new_state
    scores = (q.float() @ keys.float().transpose(-1, -2)) / math.sqrt(d)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = _causal(t, s, q.device)[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    return _masked_softmax_apply(scores, allowed, values.float()).to(v.dtype), new_state


def _causal(t: int, s: int, device) -> torch.Tensor:
    """(T, S) bool: query i (the (S − T + i)-th position) sees keys up to itself."""
    return torch.arange(s, device=device)[None, :] <= torch.arange(t, device=device)[:, None] + (s - t)
