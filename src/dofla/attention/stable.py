"""The causal stabiliser shared by the chunked/hybrid kernels and the layerwise losses.

Linear attention sums K̂_ij = Σ_m exp(log_q[i, m] + log_k[j, m]) over the keys j a row sees. To
keep the bulk as matrix products, a block of keys is shifted per feature by c_m (the block's key
maximum, at least the carried state's offset) and each row by r_i:

    K̂_ij = e^{r_i} · Σ_m exp(log_q[i, m] + c_m − r_i) · exp(log_k[j, m] − c_m).

r_i is causal: it is built only from keys row i sees (its largest single term), so a huge later
key can never push a row's terms below the float range. The per-feature shift c_m does include
later keys of the block; that is harmless unless a feature the row relies on sits more than
``GUARD`` nats below c_m, in which case the query factor would overflow and the key factor
underflow. Rows with such a feature are detected and recomputed exactly in log space (only they:
an (N, n, M) exponential for N rows, not the whole block), so the result is exact for every row.

All shifts are detached constants: the outputs do not depend on them, so gradients are exact.
Layouts: log_q (B, H, C, M) a block of rows, log_k (B, H, n, M) the block's keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is a half type (a matmul under bf16 autocast), else unchanged: the
    exp / log / sum math after a matmul stays in float32 (or float64) whatever the autocast."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def guard(dtype: torch.dtype) -> tuple[float, float]:
    """(G, E) for a dtype: query factors stay ≤ e^G; a feature contributing < e^{−E} of the row's
    largest term is negligible. E + G stays inside the normal range (e^{±87} in fp32), so every
    non-negligible term is representable."""
    return (600.0, 60.0) if dtype == torch.float64 else (55.0, 30.0)


def prefix_mask(limit: torch.Tensor, keys: int, like: torch.Tensor) -> torch.Tensor:
    """(C, keys) 0/1 in ``like``'s dtype: row i sees keys j < limit[i]."""
    return (torch.arange(keys, device=limit.device)[None, :] < limit[:, None]).to(like.dtype)


@dataclass
class Block:
    """A stabilised block. scores (B, H, C, n) = K̂_ij e^{−r_i} for visible j, 0 elsewhere;
    row_scale r (B, H, C, 1); query exp(log_q + c − r) (B, H, C, M); keys exp(log_k − c)
    (B, H, n, M); offset c (B, H, M). ``direct``: the query also reads a state rescaled to c
    exactly; otherwise read the state with exp(log_q + floor − r) at its own offset."""

    scores: torch.Tensor
    row_scale: torch.Tensor
    query: torch.Tensor
    keys: torch.Tensor
    offset: torch.Tensor
    direct: bool


def stable_block(
    log_q: torch.Tensor, log_k: torch.Tensor, limit: torch.Tensor, floor: torch.Tensor,
    mask: torch.Tensor | None = None, first_sees: bool | None = None, fast: bool | None = None,
) -> Block:
    """Causally stabilised scores of a block of rows against a block of keys.

    limit (C,) long, non-decreasing: row i sees keys j < limit[i] of this block. floor (B, H, M):
    the per-feature key maximum of everything every row sees besides (a carried state's offset;
    the dtype's most negative value if none). mask: prefix_mask(limit, n, log_q), if cached.
    first_sees: whether limit[0] > 0, when the caller knows (saves a host synchronisation).
    fast: whether the fast path holds, when the caller decided it for all its blocks at once
    (:func:`fast_path_flags`, one host synchronisation instead of one per block).
    """
    g, e = guard(log_q.dtype)
    fmin = torch.finfo(log_q.dtype).min
    n = log_k.shape[2]
    mask = prefix_mask(limit, n, log_q) if mask is None else mask
    lq, lk = log_q.detach(), log_k.detach()
    offset = torch.maximum(floor, lk.amax(2)) if n else floor
    keys = torch.exp(log_k - offset[:, :, None])
    # Lower bound of the causal row scale: every row with limit ≥ 1 sees the block's first key.
    base = torch.maximum(floor, lk[:, :, 0]) if n else floor
    r = (lq + base[:, :, None]).amax(-1, keepdim=True)
    if n and not (bool(limit[0] > 0) if first_sees is None else first_sees):
        alone = (lq + floor[:, :, None]).amax(-1, keepdim=True)
        r = torch.where((limit > 0)[:, None], r, alone)
    r = r.clamp_min(fmin)
    d = (log_q + offset[:, :, None]).sub_(r)
    if n == 0 or (fast if fast is not None else not bool(d.detach().amax() > g)):
        query = torch.exp(d)
        return Block(widened(query @ keys.transpose(-1, -2)) * mask, r, query, keys, offset, True)
    return _guarded_block(log_q, log_k, limit, floor, mask, keys, offset)


def _guarded_block(log_q, log_k, limit, floor, mask, keys, offset) -> Block:
    """The slow path: exact causal row scale (cumulative key maximum), query exponents clamped at
    G, and rows that rely on a clamped feature recomputed in log space."""
    g, e = guard(log_q.dtype)
    fmin = torch.finfo(log_q.dtype).min
    lq, lk = log_q.detach(), log_k.detach()
    seen = lk.cummax(2).values[:, :, (limit - 1).clamp_min(0)]  # (B, H, C, M) visible in-block max
    seen = seen.masked_fill((limit == 0)[:, None], float("-inf"))
    r = (lq + torch.maximum(floor[:, :, None], seen)).amax(-1, keepdim=True).clamp_min(fmin)
    d = log_q + offset[:, :, None] - r
    query = torch.exp(d.clamp_max(g))
    scores = widened(query @ keys.transpose(-1, -2)) * mask
    bad = ((d.detach() > g) & (lq + seen - r > -e)).any(-1)  # (B, H, C)
    if bool(bad.any()):
        scores = _exact_rows(scores, log_q, log_k, r, limit, bad)
    return Block(scores, r, query, keys, offset, False)


AHEAD_ON_CPU = False  # tests set it to run the device path's decisions on the CPU


def decide_ahead(x: torch.Tensor) -> bool:
    """Whether the kernels decide every block's fast path up front (one host synchronisation per
    call) rather than block by block: on a GPU, where each decision waits for the device. On the
    CPU a decision is a plain read and the block-by-block test is cheaper (no extra pass), except
    under ``torch.compile``, where each read would break the graph."""
    return x.device.type != "cpu" or AHEAD_ON_CPU or torch.compiler.is_compiling()


def block_starts(length: int, width: int, lag: int = 0) -> range:
    """The first key of every block of ``width`` keys that some row sees (row = key + lag < L)."""
    return range(0, max(0, length - lag), width)


def fast_path_flags(
    log_q: torch.Tensor, log_k: torch.Tensor, width: int, lag: int = 0, floor: torch.Tensor | None = None,
) -> list[bool]:
    """For every diagonal block at once, whether :func:`stable_block` keeps its fast path: the same
    test on the same numbers, with one host synchronisation for all blocks instead of one per block.

    Block b (of :func:`block_starts`) holds keys b·width .. (b + 1)·width (cut at L) and the rows
    from b·width + lag that see them diagonally (row b·width + lag + a sees the block's first a + 1
    keys), as in :func:`kernel_slabs` and the chunked kernel. log_q, log_k (B, H, L, M); floor
    (B, H, N, M), the carried offset each block starts from (None: the dtype's most negative value).
    """
    g, _ = guard(log_q.dtype)
    fmin = torch.finfo(log_q.dtype).min
    length = log_q.shape[2]
    count = len(block_starts(length, width, lag))
    if not count:
        return []
    size = count * width  # a cut last block repeats its last key and row: the same maxima
    blocks = lambda x: _repeat_last(x.detach(), size).reshape(*x.shape[:2], count, width, x.shape[-1])  # noqa: E731
    lq, lk = blocks(log_q[:, :, lag:lag + size]), blocks(log_k[:, :, :size])  # (B, H, N, width, M)
    if floor is None:
        floor = lq.new_full((*lq.shape[:3], lq.shape[-1]), fmin)
    offset = torch.maximum(floor, lk.amax(3))
    base = torch.maximum(floor, lk[:, :, :, 0])
    r = (lq + base[:, :, :, None]).amax(-1).clamp_min(fmin)
    over = ((lq + offset[:, :, :, None]).amax(-1) - r).amax((0, 1, 3)) > g  # max_m(x_m) − r = max_m(x_m − r)
    return [not x for x in over.tolist()]


def _repeat_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """x (B, H, n, M) with its last row repeated up to ``size`` rows."""
    extra = size - x.shape[2]
    return x if extra <= 0 else torch.cat([x, x[:, :, -1:].expand(-1, -1, extra, -1)], 2)


EXACT_ELEMENTS = 1 << 24  # at most this many (row, key, feature) terms per exact group (64 MiB fp32)


def _exact_rows(scores, log_q, log_k, r, limit, bad) -> torch.Tensor:
    """Replace the ``bad`` rows (B, H, C) of scores by Σ_m exp(log_q + log_k − r), term by term,
    in groups of rows so the (N, n, M) terms stay bounded in memory."""
    b, h, i = bad.nonzero(as_tuple=True)
    n, m = log_k.shape[2], log_k.shape[3]
    group = max(1, EXACT_ELEMENTS // max(1, n * m))
    for lo in range(0, b.numel(), group):
        bb, hh, ii = b[lo:lo + group], h[lo:lo + group], i[lo:lo + group]
        x = log_q[bb, hh, ii][:, None, :] + log_k[bb, hh] - r[bb, hh, ii][:, :, None]  # (N, n, M)
        hidden = torch.arange(n, device=x.device)[None, :] >= limit[ii][:, None]
        rows = torch.exp(x.masked_fill(hidden[..., None], float("-inf"))).sum(-1)
        scores = scores.index_put((bb, hh, ii), rows)
    return scores


def kernel_slabs(log_q: torch.Tensor, log_k: torch.Tensor, lag: int = 0, block: int = 128):
    """Yield (row0, start, scores, r, diagonal) pieces per column block of keys start..start+n,
    row i seeing keys j ≤ i − lag: scores (B, H, R, n) = K̂_ij e^{−r_i} for rows row0..row0+R
    (0 where hidden), r (B, H, R, 1). Each block's rows get their own causal scale. The block's
    diagonal rows (``diagonal`` True: row row0+a sees keys start..start+a) go through
    :func:`stable_block`; the rows after them see the whole block, whose offset is causal for them.
    log_q, log_k (B, H, L, M)."""
    b, h, length, m = log_q.shape
    fmin = torch.finfo(log_q.dtype).min
    floor = log_q.new_full((b, h, m), fmin)
    starts = block_starts(length, block, lag)
    if not starts:  # every row's keys are within the lag: nothing to approximate
        return
    ahead = fast_path_flags(log_q, log_k, block, lag) if decide_ahead(log_q) else [None] * len(starts)
    rows, keys = _pieces(log_q, log_k, lag, block, len(starts))
    for start, fast, lq, lk in zip(starts, ahead, rows, keys):
        first = start + lag  # first row that sees key `start`
        diag = lq.shape[2]
        blk = stable_block(lq, lk, torch.arange(1, diag + 1, device=lk.device), floor, first_sees=True, fast=fast)
        yield first, start, blk.scores, blk.row_scale, True
        later = log_q[:, :, first + diag:]
        if later.shape[2]:
            c = blk.offset[:, :, None]
            r_late = (later.detach() + c).amax(-1, keepdim=True).clamp_min(fmin)
            s_late = widened(torch.exp(later - r_late + c) @ blk.keys.transpose(-1, -2))
            yield first + diag, start, s_late, r_late, False


def _pieces(log_q: torch.Tensor, log_k: torch.Tensor, lag: int, block: int, count: int):
    """Each block's diagonal rows (lag + b·block ..) and keys (b·block ..), cut by one split of
    each tensor: under autograd a split's backward is one concatenation, where a slice per block
    zero-fills and adds a whole (B, H, L, M) gradient."""
    length, keys = log_q.shape[2], log_k.shape[2]
    row_sizes = [lag] + [min(block, length - lag - b * block) for b in range(count)]
    key_sizes = [min(block, keys - b * block) for b in range(count)]
    return (log_q.split(row_sizes + [length - sum(row_sizes)], 2)[1:count + 1],
            log_k.split(key_sizes + [keys - sum(key_sizes)], 2)[:count])


def merge_normaliser(parts: list[tuple[int, torch.Tensor]], length: int, like: torch.Tensor) -> torch.Tensor:
    """log Σ of (row0, log partial sum (B, H, R, 1)) pieces -> (B, H, L, 1), −inf where none."""
    if not parts:
        return like.new_full((*like.shape[:2], length, 1), float("-inf"))
    pad = torch.nn.functional.pad
    padded = [pad(x, (0, 0, row0, length - row0 - x.shape[2]), value=float("-inf")) for row0, x in parts]
    return torch.logsumexp(torch.cat(padded, dim=-1), dim=-1, keepdim=True)


def causal_log_kernel(
    log_q: torch.Tensor, log_k: torch.Tensor, lag: int = 0, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log K̂ (B, H, L, L), log normaliser (B, H, L, 1)) where row i sees keys j ≤ i − lag.

    log_q, log_k (B, H, L, M). Hidden entries are −inf; a visible K̂_ij below the dtype's normal
    range relative to the row's largest term is floored there (finite, no gradient). The
    normaliser is log Σ_{j ≤ i−lag} K̂_ij (−inf for a row that sees nothing).
    """
    length, tiny = log_q.shape[2], torch.finfo(log_q.dtype).tiny
    out = log_q.new_full((*log_q.shape[:2], length, length), float("-inf"))
    parts = []
    for row0, start, scores, r, diagonal in kernel_slabs(log_q, log_k, lag, block):
        rows, n = scores.shape[2], scores.shape[3]
        view = out[:, :, row0:row0 + rows, start:start + n]
        view.copy_(r + torch.log(scores.clamp_min(tiny)))
        if diagonal:
            view.masked_fill_(torch.ones(rows, n, dtype=torch.bool, device=out.device).triu_(1), float("-inf"))
        parts.append((row0, r + torch.log(scores.sum(-1, keepdim=True).clamp_min(tiny))))
    return out, merge_normaliser(parts, length, log_q)
