"""Hybrid attention: exact softmax over the last W tokens, linear attention for everything older.

Query i attends with the softmax kernel exp(q_i·k_j/sqrt(d)) to keys i−W < j ≤ i and with the
learned kernel K̂(q_i, k_j) = Φ(q_i)·Φ(k_j) to keys j ≤ i−W, normalised together:

    y_i = (Σ_exact e^{s_ij} v_j + Σ_older K̂_ij v_j) / (Σ_exact e^{s_ij} + Σ_older K̂_ij)

With ``sinks`` > 0 the first ``sinks`` tokens of the sequence are exact too (attention sinks):
"exact" is the window plus the sinks, "older" everything else before the window.

PRF-type features estimate the same kernel, so both parts share one scale. W = 0 is pure linear
attention (the paper's setting). Decoding keeps the last W keys/values plus the linear state of
the older tokens and the sinks: memory O(sinks + W + M·dv) per head, not O(T). The linear
part's row scale uses only keys that have left the row's window (:mod:`dofla.attention.stable`).

Layouts: q, k (B, H, T, d) with q scaled so the kernel is exp(q·k/sqrt(d)); v (B, H, T, dv);
log_q, log_k (B, H, T, M) feature-map log features. Keys/values already expanded to H heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dofla.attention.linear import LinearState, chunk_step
from dofla.attention.naive import log_kernel_matrix, masked_softmax


@dataclass
class HybridState:
    """Linear state of tokens older than the window (sinks excepted), the window's last ≤ W
    keys/values, and the sink tokens that have left the window, each with key validity.

    k (B, H, n, d), v (B, H, n, dv), log_k (B, H, n, M), valid (B, n); sink_k (B, H, s, d),
    sink_v (B, H, s, dv), sink_valid (B, s) with s ≤ sinks.
    """

    linear: LinearState
    k: torch.Tensor
    v: torch.Tensor
    log_k: torch.Tensor
    valid: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_valid: torch.Tensor

    @property
    def length(self) -> int:
        return self.linear.length + self.sink_k.shape[2] + self.k.shape[2]

    def _tensors(self):
        return (self.k, self.v, self.log_k, self.valid, self.sink_k, self.sink_v, self.sink_valid)

    def index_select(self, index: torch.Tensor) -> "HybridState":
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        return HybridState(self.linear.index_select(index), *(pick(t) for t in self._tensors()))

    def nbytes(self) -> int:
        return self.linear.nbytes() + sum(t.numel() * t.element_size() for t in self._tensors())


def _exact_mask(queries: int, keys: int, window: int, sinks: int, device, first: int = 0) -> torch.Tensor:
    """(T, S) bool: which keys each query attends to exactly (window or sink, causal).

    Queries are the last T of the S key positions; ``first`` is the absolute position of key 0,
    so the sink test (position < sinks) uses absolute positions.
    """
    i = torch.arange(queries, device=device)[:, None] + (keys - queries)
    j = torch.arange(keys, device=device)[None, :]
    return (j <= i) & ((j > i - window) | (j + first < sinks))


def exact_logits(q: torch.Tensor, k: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """(B, H, T, S) q·k/sqrt(d), soft-capped to softcap·tanh(·/softcap) when given (Gemma 2)."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def hybrid_log_scores(q, k, log_q, log_k, window: int, sinks: int = 0, key_valid=None, softcap=None) -> torch.Tensor:
    """The quadratic reference's (B, H, T, T) log-kernel matrix: softmax inside the window and on
    the first ``sinks`` tokens, log K̂ elsewhere, −inf above the diagonal and on padding keys."""
    t = q.shape[2]
    exact = _exact_mask(t, t, window, sinks, q.device)
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    if key_valid is not None:
        visible = visible & key_valid.to(torch.bool)[:, None, None, :]
        log_k = log_k.masked_fill(~key_valid.to(torch.bool)[:, None, :, None], 0.0)  # finite: no NaN grads
    scores = torch.where(exact, exact_logits(q, k, softcap), log_kernel_matrix(log_q, log_k))
    return scores.masked_fill(~visible, float("-inf"))


def hybrid_attention_naive(
    q, k, v, log_q, log_k, window: int, *, sinks: int = 0, key_valid: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Quadratic reference: materialise the T×T log scores, softmax over keys, apply to v.
    A row that sees no valid key outputs 0."""
    return masked_softmax(hybrid_log_scores(q, k, log_q, log_k, window, sinks, key_valid, softcap)).to(v.dtype) @ v


def _empty_state(q, v, log_k, dtype) -> HybridState:
    b, h, _, m = log_k.shape
    linear = LinearState.zeros(b, h, m, v.shape[-1], dtype, v.device)
    empty = lambda last: q.new_zeros(b, h, 0, last, dtype=dtype)  # noqa: E731
    none = torch.zeros(b, 0, dtype=torch.bool, device=q.device)
    return HybridState(linear, empty(q.shape[-1]), empty(v.shape[-1]), empty(m), none,
                       empty(q.shape[-1]), empty(v.shape[-1]), none)


def _linear_part(log_q, ctx_lk, ctx_v, lin_ok, state: HybridState, limit):
    """Linear attention of the new rows over the state and the context keys that left their window:
    (total (B, H, C, dv+1) at row scale r, r, new LinearState without length)."""
    leave = lin_ok.shape[1]
    drop = ~lin_ok[:, None, :, None]
    lk = ctx_lk[:, :, :leave].masked_fill(drop, float("-inf"))
    vals = torch.cat([ctx_v[:, :, :leave], ctx_v.new_ones(*ctx_v.shape[:2], leave, 1)], -1).masked_fill(drop, 0.0)
    kv1 = torch.cat([state.linear.kv, state.linear.k_sum[..., None]], dim=-1)
    total, r, kv1, offset = chunk_step(log_q, lk, vals, kv1, state.linear.offset, limit)
    return total, r, LinearState(kv1[..., :-1], kv1[..., -1], offset, state.linear.length)


def _step(q, k, v, log_q, log_k, valid, state: HybridState, window: int, sinks: int, softcap=None):
    """New tokens (C of them) against [sinks ; window buffer ; new tokens]; returns (out, new state)."""
    n_b, c, dv = state.k.shape[2], q.shape[2], v.shape[-1]
    ctx_k, ctx_v, ctx_lk = (torch.cat([a, b], dim=2) for a, b in ((state.k, k), (state.v, v), (state.log_k, log_k)))
    ctx_valid = torch.cat([state.valid, valid], dim=1)  # (B, n_b + C)
    first = state.length - n_b  # absolute position of ctx token 0
    pos = torch.arange(n_b + c, device=q.device) + first
    leave = max(0, n_b + c - window)  # tokens that fall out of the window after this step
    limit = (torch.arange(c, device=q.device) + n_b - window + 1).clamp(0, leave)
    lin_ok = ctx_valid[:, :leave] & (pos[:leave] >= sinks)
    total, r, linear = _linear_part(log_q, ctx_lk, ctx_v, lin_ok, state, limit)

    exact = _exact_mask(c, n_b + c, window, sinks, q.device, first)[None] & ctx_valid[:, None, :]
    keys, vals = ctx_k, ctx_v
    if state.sink_k.shape[2]:
        exact = torch.cat([state.sink_valid[:, None, :].expand(-1, c, -1), exact], dim=2)
        keys, vals = torch.cat([state.sink_k, ctx_k], dim=2), torch.cat([state.sink_v, ctx_v], dim=2)
    exact = exact[:, None]  # (B, 1, C, S): the same for every head
    s = exact_logits(q, keys, softcap).masked_fill(~exact, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
    p = torch.exp(s - mx)
    top = torch.maximum(r, mx)  # flash-style merge of the two partial sums
    w_l, w_s = torch.exp(r - top), torch.exp(mx - top)
    num = w_l * total[..., :dv] + w_s * (p @ vals)
    den = w_l * total[..., dv:] + w_s * p.sum(-1, keepdim=True)
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)

    to_sink = int((pos[:leave] < sinks).sum())  # leaving sink tokens: a prefix of the leavers
    linear.length = state.linear.length + leave - to_sink
    grab = lambda a, b: torch.cat([a, b[:, :, :to_sink]], dim=2)  # noqa: E731
    new = HybridState(linear, ctx_k[:, :, leave:], ctx_v[:, :, leave:], ctx_lk[:, :, leave:], ctx_valid[:, leave:],
                      grab(state.sink_k, ctx_k), grab(state.sink_v, ctx_v),
                      torch.cat([state.sink_valid, ctx_valid[:, :to_sink]], dim=1))
    return out, new


def hybrid_attention_chunked(
    q, k, v, log_q, log_k, window: int, chunk_size: int | None = None, state: HybridState | None = None,
    *, sinks: int = 0, key_valid: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, HybridState]:
    """Hybrid attention in chunks (default chunk = window); continues from ``state``.

    Work per chunk is O(C·(sinks + W + C)) for the exact part and O(C·M·dv) for the linear part;
    decoding one token at a time is the same call with T = 1. key_valid (B, T) bool marks the new
    tokens' real keys (False = padding); a row that sees no valid key outputs 0. ``softcap``
    caps the exact part's logits as the teacher does (Gemma 2); None = no capping.
    """
    if window < 1:
        raise ValueError(f"window must be ≥ 1 for hybrid attention, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be a positive number (or None for no capping)")
    if sinks < 0:
        raise ValueError(f"sinks must be ≥ 0 (number of leading tokens kept exact), got {sinks}")
    out_dtype, (b, _, t, _) = v.dtype, q.shape
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.promote_types(log_q.dtype, torch.float32))
    q, k, v, log_q, log_k = (x.to(dtype) for x in (q, k, v, log_q, log_k))
    if key_valid is None:
        key_valid = torch.ones(b, t, dtype=torch.bool, device=q.device)
    elif key_valid.shape != (b, t):
        raise ValueError(f"key_valid must be (B, T) = {(b, t)} bool for the new tokens; got {tuple(key_valid.shape)}")
    state = _cast(state, dtype) if state is not None else _empty_state(q, v, log_k, dtype)
    chunk = chunk_size or window
    outs = []
    for start in range(0, t, chunk):
        sl = slice(start, start + chunk)
        out, state = _step(q[:, :, sl], k[:, :, sl], v[:, :, sl], log_q[:, :, sl], log_k[:, :, sl],
                           key_valid[:, sl].to(torch.bool), state, window, sinks, softcap)
        outs.append(out)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.cat(outs, dim=2).to(out_dtype), state


def _cast(state: HybridState, dtype: torch.dtype) -> HybridState:
    f = lambda t: t.to(dtype)  # noqa: E731
    return HybridState(state.linear.to(dtype), f(state.k), f(state.v), f(state.log_k), state.valid,
                       f(state.sink_k), f(state.sink_v), state.sink_valid)
