"""Chunks of the chunked linear kernel batched in groups (:func:`chunk_group`).

Per chunk, the kernel's work is a handful of small products and element-wise ops; one at a time,
each is a separate op over a few hundred kilobytes. A group of g full chunks does each step once
for all g (the in-chunk products as one batched product each, the exponentials as one pass), and
only the carried state advances chunk by chunk, by one multiply-add each. The numbers are the
ones :func:`dofla.attention.linear.chunk_step` computes on the stabiliser's fast path
(:mod:`dofla.attention.stable`); a group with a chunk that needs the guarded path is handed back.
Groups of about ``GROUP_TOKENS`` tokens keep a group's tensors in cache.

Layouts: log_q, log_k (B, H, g·C, M); values (B, H, g·C, e); state (B, H, M, e); offsets (B, H, M).
"""
from __future__ import annotations

import torch

from dofla.attention.stable import guard, widened

GROUP_TOKENS = 512  # chunks are batched in groups of about this many tokens (fastest measured on CPU)


def carry_decay(kv1: torch.Tensor, offset: torch.Tensor, decay: torch.Tensor):
    """The state (kv1 (B, H, M, e) at offset (B, H, M)) decayed by e^{decay}, decay (B, H, 1): the
    offset moves by the detached decay, kv1 takes a factor of value 1 that carries its gradient."""
    fixed = decay.detach()
    return kv1 * torch.exp(decay - fixed)[..., None], offset + fixed


def _group_offsets(offset, key_max, totals=None):
    """(floors, offsets) (B, H, g, M) of g consecutive chunks: the state's offset as each chunk
    starts (after the previous chunks and their decays) and that offset raised to the chunk's key
    maximum (B, H, g, M); totals (B, H, g, 1): each chunk's total log decay (None: ungated)."""
    if totals is None:  # a running maximum: the same numbers as advancing chunk by chunk
        running = torch.cat([offset[:, :, None], key_max], 2).cummax(2).values
        return running[:, :, :-1], running[:, :, 1:]
    floors, offsets = [], []
    for c in range(key_max.shape[2]):
        floors.append(offset)
        offsets.append(torch.maximum(offset, key_max[:, :, c]))
        offset = offsets[-1] + totals[:, :, c].detach()
    return torch.stack(floors, 2), torch.stack(offsets, 2)


def chunk_group(log_q, log_k, vals, kv1, offset, chunk: int, decay=None, fast: bool | None = None):
    """g full chunks at once, as :func:`dofla.attention.linear.chunk_step` computes each on its fast path: the in-chunk
    products of all g chunks are one batched product each, only the carried state advances chunk by
    chunk. log_q, log_k (B, H, g·C, M); vals (B, H, g·C, e); kv1 (B, H, M, e) at ``offset`` (B, H, M);
    decay (B, H, g·C, 1) counted from each chunk's start, or None. Returns (total (B, H, g·C, e),
    kv1', offset'), or None when some chunk needs the stabiliser's guarded path (``fast`` False, or
    None and found so here)."""
    b, h, n, m = log_k.shape
    g, e = n // chunk, vals.shape[-1]
    lq, lk = log_q.view(b, h, g, chunk, m), log_k.view(b, h, g, chunk, m)
    totals = None
    if decay is not None:
        dec = decay.view(b, h, g, chunk, 1)
        lq, lk, totals = lq + dec, lk - dec, dec[:, :, :, -1]
    held = lk.detach()
    floors, offsets = _group_offsets(offset, held.amax(3), totals)
    # the causal row scale of stable_block: every row sees its chunk's first key
    base = torch.maximum(floors, held[:, :, :, 0])
    r = (lq.detach() + base[:, :, :, None]).amax(-1, keepdim=True).clamp_min(torch.finfo(lq.dtype).min)
    d = (lq + offsets[:, :, :, None]).sub_(r)
    if fast is None:  # d ≤ max_m(offset − base) (as lq + base ≤ r): read d itself only when that bound fails
        g_max = guard(d.dtype)[0]
        fast = bool((offsets - base).amax() <= g_max) or not bool(d.detach().amax() > g_max)
    if not fast:
        return None
    query, keys = d.exp_(), (lk - offsets[:, :, :, None]).exp_()  # (B, H, g, C, M)
    v5 = vals.view(b, h, g, chunk, e)
    within = widened(query @ keys.transpose(-1, -2)).tril_() @ v5  # (B, H, g, C, e)
    added = keys.transpose(-1, -2) @ v5  # (B, H, g, M, e): each chunk's keys into the state
    factors = torch.exp(floors - offsets)[..., None]  # the state from each chunk's floor to its offset
    reads = []
    for c in range(g):
        kv1 = kv1 * factors[:, :, c]
        reads.append(kv1)
        kv1 = kv1 + added[:, :, c]
        if totals is not None:
            kv1, _ = carry_decay(kv1, offsets[:, :, c], totals[:, :, c])
    reads = torch.stack(reads, 2)  # (B, H, g, M, e)
    if within.dtype == query.dtype:  # add the state's part in place (autocast may have lowered `within`)
        total = within.view(-1, chunk, e).baddbmm_(query.view(-1, chunk, m), reads.view(-1, m, e))
    else:
        total = within + query @ reads
    offset = offsets[:, :, -1] if totals is None else offsets[:, :, -1] + totals[:, :, -1].detach()
    return total.view(b, h, n, e), kv1, offset
