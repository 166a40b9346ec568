"""The teacher's activations a streamed layerwise trainer reads: q, k (and v) of chosen layers from one
forward that stops after the deepest of them, and held-out q, k, v per layer (from held-out token rows,
or from the last sequences of an activation cache)."""
from __future__ import annotations

from typing import Callable

import torch

from dofla.models.adapters import get_adapter
from dofla.models.capture import capturing


class _Captured(Exception):
    """Raised from the capture callback once the deepest needed layer is captured: ends the forward."""


@torch.no_grad()
def teacher_qk(teacher, modules, input_ids: torch.Tensor, layers: list[int], values: bool = False) -> dict[int, tuple]:
    """{layer: (q (B, H, L, d), k (B, H_kv, L, d), v (B, H_kv, L, d) or None unless ``values``)} in
    fp32 for ``layers``; the forward stops right after the deepest of them."""
    wanted, deepest, captured = set(layers), max(layers), {}

    def grab(i, q, k, v):
        if i in wanted:
            captured[i] = (q.float(), k.float(), v.float() if values else None)
        if i == deepest:
            raise _Captured

    with capturing(teacher, modules, grab):
        try:
            teacher(input_ids=input_ids, use_cache=False)
        except _Captured:
            pass
    return captured


def teacher_heldout(teacher, tokens: torch.Tensor, layers: list[int], batch_size: int = 4) -> dict[int, tuple]:
    """Held-out q (S, H, L, d), k and v (S, H_kv, L, d) per layer from held-out token rows (S, L), on
    CPU. Use text the stream never serves: the source's "heldout" split, or see ``cache_heldout``."""
    device = next(teacher.parameters()).device
    modules = get_adapter(teacher).attention_modules(teacher)
    parts = [teacher_qk(teacher, modules, rows.to(device), layers, values=True) for rows in tokens.split(batch_size)]
    return {i: tuple(torch.cat([p[i][j].cpu() for p in parts]) for j in range(3)) for i in layers}


def cache_heldout(cache, num_seqs: int = 4) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """Held-out q, k, v per layer: the last ``num_seqs`` sequences of an activation cache (fp16 → fp32);
    only held out when the stream skips the cached tokens first (``BatchStream.discard``)."""
    def layer(i: int) -> tuple[torch.Tensor, ...]:
        return cache.layer(i).torch(slice(-num_seqs, None))
    return layer
