"""Sliding-window attention with attention sinks (the StreamingLLM recipe), training-free.

Query i attends with the exact softmax kernel exp(q_i·k_j/sqrt(d)) to the keys of the last
``window`` positions (i−W < j ≤ i) plus the ``sinks`` first *valid* tokens of its sequence, each
key counted once. Nothing else is seen, so decoding needs only the S sink keys/values and the last
W−1 positions: memory O(S + W) per head, whatever the number of tokens.

Padding: ``key_valid`` (B, T) bool marks real tokens; masked keys are never attended to. The
window is positional (the last W positions, pads included), exactly as Hugging Face's sliding
window masks are, and the sinks are the first S valid tokens of each row, so a left-padded row
sees the same keys as the same row alone. A query with no visible key (a pad before any real
token) gets a zero output. ``softcap`` (Gemma 2) replaces each score s by cap·tanh(s/cap).

Layouts: q (B, H, T, d), k (B, H_kv, T, d) with q scaled so the kernel is exp(q·k/sqrt(d)); v (B, H_kv, T,
dv); outputs (B, H, T, dv). Grouped-query attention: H_kv divides H and query head h reads KV head
h // (H / H_kv) (Hugging Face's ``repeat_kv`` order), so the window holds each KV head's keys and values
once, as the teacher's cache does, not once per query head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SlidingState:
    """Decode state: the sinks seen so far and the last ≤ W−1 positions' keys/values.

    sink_k (B, H_kv, S, d), sink_v (B, H_kv, S, dv), sink_valid (B, S): filled slots, per row.
    k (B, H_kv, n, d), v (B, H_kv, n, dv), valid (B, n): the last n ≤ W−1 positions; ``valid`` is False
    for pads and for tokens already held as sinks (so no key is counted twice).
    ``length``: positions processed (pads included).
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_valid: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    length: int = 0

    def index_select(self, index: torch.Tensor) -> "SlidingState":
        """Reorder/select batch rows (beam search)."""
        index = index.to(self.k.device)
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return SlidingState(pick(self.sink_k), pick(self.sink_v), pick(self.sink_valid),
                            pick(self.k), pick(self.v), pick(self.valid), self.length)

    def nbytes(self) -> int:
        tensors = (self.sink_k, self.sink_v, self.sink_valid, self.k, self.v, self.valid)
        return sum(t.numel() * t.element_size() for t in tensors)


def _check(window: int, sinks: int) -> None:
    if window < 1:
        raise ValueError(f"window must be ≥ 1 for sliding-window attention, got {window}")
    if sinks < 0:
        raise ValueError(f"sinks must be ≥ 0, got {sinks}")


def _check_groups(q, k) -> int:
    """Query heads per KV head."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads cannot serve {q.shape[1]} query heads: the number of query "
                         "heads must be a multiple of the number of key/value heads")
    return q.shape[1] // k.shape[1]


def _scores(q, k, softcap: float | None) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _masked_softmax_apply(s, allowed, v) -> torch.Tensor:
    """Softmax of scores s (B, H, C, N) over allowed keys (B, 1|H, C, N), applied to v; rows with no
    allowed key give 0."""
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    return (p @ v) / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def sliding_window_naive(
    q, k, v, window: int, sinks: int = 4, key_valid: torch.Tensor | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Quadratic reference: materialise the (B, T, T) visibility mask, softmax over visible keys (each query
    head over its KV head's keys, copied out to every query head)."""
    _check(window, sinks)
    group = _check_groups(q, k)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    b, _, t, _ = q.shape
    valid = torch.ones(b, t, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.bool()
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    is_sink = valid & (valid.cumsum(-1) <= sinks)
    allowed = (j <= i) & valid[:, None, :] & ((j > i - window) | is_sink[:, None, :])
    out = _masked_softmax_apply(_scores(q.float(), k.float(), softcap), allowed[:, None], v.float())
    return out.to(v.dtype)


def empty_sliding_state(batch: int, heads: int, head_dim: int, value_dim: int, sinks: int,
                        dtype=torch.float32, device=None) -> SlidingState:
    """A state before any token: S empty sink slots and no window positions, for ``heads`` KV heads."""
    zeros = lambda n, last: torch.zeros(batch, heads, n, last, dtype=dtype, device=device)  # noqa: E731
    no = lambda n: torch.zeros(batch, n, dtype=torch.bool, device=device)  # noqa: E731
    return SlidingState(zeros(sinks, head_dim), zeros(sinks, value_dim), no(sinks),
                        zeros(0, head_dim), zeros(0, value_dim), no(0), 0)


def _step(q, k, v, valid, state: SlidingState, window: int, sinks: int, softcap):
    """C new tokens against [sinks ; last n positions ; new tokens]; returns (out, new state). The G query
    heads of a KV head are its rows: q (B, H, C, d) is read as (B, H_kv, G·C, d), no key is copied."""
    n, c = state.k.shape[2], q.shape[2]
    b, h, _, d = q.shape
    group = h // k.shape[1]
    rank = state.sink_valid.sum(-1, keepdim=True) + valid.cumsum(-1) - 1  # sink slot of each valid token
    is_sink = valid & (rank < sinks)
    ctx_k = torch.cat([state.sink_k, state.k, k], dim=2)  # (B, H, S + n + C, d)
    ctx_v = torch.cat([state.sink_v, state.v, v], dim=2)
    a = torch.arange(c, device=q.device)[:, None] + n  # query position among the last n + C
    t = torch.arange(n + c, device=q.device)[None, :]
    local_valid = torch.cat([state.valid, valid], dim=-1)[:, None, :]  # (B, 1, n + C)
    local_sink = torch.cat([torch.zeros_like(state.valid), is_sink], dim=-1)[:, None, :]
    local = (t <= a) & local_valid & ((t > a - window) | local_sink)  # (B, C, n + C)
    allowed = torch.cat([state.sink_valid[:, None, :].expand(-1, c, -1), local], dim=-1)  # (B, C, S + n + C)
    rows = q.reshape(b, h // group, group * c, d)  # (B, H_kv, G·C, d): query head kv·G + r, position i at r·C + i
    allowed = allowed[:, None, None].expand(-1, 1, group, -1, -1).reshape(b, 1, group * c, allowed.shape[-1])
    out = _masked_softmax_apply(_scores(rows, ctx_k, softcap), allowed, ctx_v).reshape(b, h, c, -1)

    sink_k, sink_v, sink_valid = state.sink_k, state.sink_v, state.sink_valid
    if sinks > 0 and bool(is_sink.any()):
        slot = torch.where(is_sink, rank, torch.full_like(rank, sinks))  # non-sinks go to a spare slot
        sink_k = _scatter_slots(sink_k, slot, k)
        sink_v = _scatter_slots(sink_v, slot, v)
        spare = torch.cat([sink_valid, sink_valid.new_zeros(sink_valid.shape[0], 1)], dim=1)
        sink_valid = spare.scatter(1, slot, is_sink)[:, :sinks] | sink_valid
    drop = n + c - min(window - 1, n + c)  # positions that leave the window for good
    keep_valid = torch.cat([state.valid, valid & ~is_sink], dim=-1)[:, drop:]
    new = SlidingState(sink_k, sink_v, sink_valid, ctx_k[:, :, sinks + drop:], ctx_v[:, :, sinks + drop:],
                       keep_valid, state.length + c)
    return out, new


def _scatter_slots(buffer: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Write x[:, :, i] (B, H, C, D) into buffer slot slot[:, i] (B, C); slot S is a spare, dropped."""
    b, h, s, d = buffer.shape
    spare = torch.cat([buffer, buffer.new_zeros(b, h, 1, d)], dim=2)
    index = slot[:, None, :, None].expand(b, h, slot.shape[1], d)
    return spare.scatter(2, index, x.to(buffer.dtype))[:, :, :s]


def sliding_window_chunked(
    q, k, v, window: int, sinks: int = 4, chunk_size: int | None = None,
    state: SlidingState | None = None, key_valid: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, SlidingState]:
    """Sliding-window + sinks attention in chunks (default chunk = window); continues from ``state``.

    Memory per chunk is O(C·(S + W + C)) scores, never T²; decoding one token is the same call with
    T = 1. k, v may have fewer heads than q (grouped-query attention): the state holds them unexpanded.
    Computes in ≥ fp32 and returns v's dtype.
    """
    _check(window, sinks)
    _check_groups(q, k)
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    b, h, t, d = q.shape
    valid = torch.ones(b, t, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.bool()
    q, k = q.to(dtype), k.to(dtype)
    v = v.to(dtype).masked_fill(~valid[:, None, :, None], 0.0)  # pads never reach an output
    state = state or empty_sliding_state(b, k.shape[1], d, v.shape[-1], sinks, dtype, q.device)
    chunk = chunk_size or window
    outs = []
    for start in range(0, t, chunk):
        sl = slice(start, start + chunk)
        out, state = _step(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl], state, window, sinks, softcap)
        outs.append(out)
    if not outs:
        return v.new_zeros(b, h, 0, v.shape[-1]).to(out_dtype), state
    return torch.cat(outs, dim=2).to(out_dtype), state
