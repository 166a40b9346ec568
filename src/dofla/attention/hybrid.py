"""Hybrid attention: exact softmax over the last W tokens, linear attention for everything older.

Query i attends with the softmax kernel exp(q_i·k_j/sqrt(d)) to keys i−W < j ≤ i and with the
learned kernel K̂(q_i, k_j) = Φ(q_i)·Φ(k_j) to keys j ≤ i−W, normalised together:

    y_i = (Σ_exact e^{s_ij} v_j + Σ_older K̂_ij v_j) / (Σ_exact e^{s_ij} + Σ_older K̂_ij)

With ``sinks`` > 0 the first ``sinks`` valid tokens of each row are exact too (attention sinks):
"exact" is the window plus the sinks, "older" everything else before the window; no key is in
both. Padding: ``key_valid`` (B, T) marks real tokens and pads are never attended to. The window
is positional (the last W positions, pads included), the sinks are counted in valid tokens, so a
left-padded row has the same sinks as the same row alone (as in :mod:`dofla.attention.sliding`).

PRF-type features estimate the same kernel, so both parts share one scale. W = 0 is pure linear
attention (the paper's setting). A decay gate (``log_decay`` a_t ≤ 0 per head and token,
:mod:`dofla.attention.gate`) weights an older key by exp(a_{j+1} + … + a_i), as in gated linear
attention; the exact part does not decay. Decoding keeps the last W keys/values plus the linear
state of the older tokens and the sinks: memory O(sinks + W + M·dv) per head, not O(T). The linear
part's row scale uses only keys that have left the row's window (:mod:`dofla.attention.stable`).

A ``far`` reader (:mod:`dofla.attention.delta_hybrid`) replaces the older keys' numerator: the
linear part then keeps only its mass Σ_older K̂_ij (a state of M numbers per head), and the older
tokens' output is the reader's, weighted by that mass:
y_i = (Σ_exact e^{s_ij} v_j + Σ_older K̂_ij · ô_i) / (Σ_exact e^{s_ij} + Σ_older K̂_ij).

Layouts: q, k (B, H, T, d) with q scaled so the kernel is exp(q·k/sqrt(d)); v (B, H, T, dv);
log_q, log_k (B, H, T, M) feature-map log features. Keys/values already expanded to H heads. Grouped-query
attention (``group`` > 1: each run of ``group`` heads repeats one KV head's keys and values): the decoding
state holds the window's and the sinks' keys and values once per KV head, and the exact part reads them
with each KV head's queries as rows; the features, decays and the linear part stay per query head.
"""
from __future__ import annotations

import math
import torch

from dofla.attention.hybrid_state import HybridState
from dofla.attention.linear import LinearState, carry_decay, chunk_step
from dofla.attention.naive import log_kernel_matrix, masked_softmax
from dofla.attention.stable import widened


def _exact_mask(queries: int, keys: int, window: int, sink: torch.Tensor, device) -> torch.Tensor:
    """(B, T, S) bool: which keys each query attends to exactly (in its window or a sink, causal).

    Queries are the last T of the S key positions; sink (B, S) marks each row's sink keys.
    """
    i = torch.arange(queries, device=device)[:, None] + (keys - queries)
    j = torch.arange(keys, device=device)[None, :]
    return (j <= i) & ((j > i - window) | sink[:, None, :])


def _sink_keys(valid: torch.Tensor, sinks: int, seen: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: the keys among the first ``sinks`` valid keys of their row, given ``seen`` (B,)
    valid keys before these (None: none). valid (B, T) bool."""
    rank = valid.cumsum(-1) if seen is None else valid.cumsum(-1) + seen[:, None]
    return valid & (rank <= sinks)


def exact_logits(q: torch.Tensor, k: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """(B, H, T, S) q·k/sqrt(d), soft-capped to softcap·tanh(·/softcap) when given (Gemma 2)."""
    s = widened(q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def hybrid_log_scores(q, k, log_q, log_k, window: int, sinks: int = 0, key_valid=None, softcap=None,
                      log_decay=None) -> torch.Tensor:
    """The quadratic reference's (B, H, T, T) log-kernel matrix: softmax inside the window and on
    each row's first ``sinks`` valid keys, log K̂ elsewhere (plus A_i − A_j, A the cumulative sum of
    ``log_decay`` (B, H, T) with pads at 0), −inf above the diagonal and on padding keys."""
    b, _, t, _ = q.shape
    valid = torch.ones(b, t, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.to(torch.bool)
    exact = _exact_mask(t, t, window, _sink_keys(valid, sinks), q.device)[:, None]
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    if key_valid is not None:
        visible = visible & valid[:, None, None, :]
        log_k = log_k.masked_fill(~valid[:, None, :, None], 0.0)  # finite: no NaN grads
    older = log_kernel_matrix(log_q, log_k)
    if log_decay is not None:
        cumulative = log_decay.masked_fill(~valid[:, None, :], 0.0).cumsum(-1)
        older = older + cumulative[..., :, None] - cumulative[..., None, :]
    scores = torch.where(exact, exact_logits(q, k, softcap), older)
    return scores.masked_fill(~visible, float("-inf"))


def hybrid_attention_naive(
    q, k, v, log_q, log_k, window: int, *, sinks: int = 0, key_valid: torch.Tensor | None = None,
    softcap: float | None = None, log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quadratic reference: materialise the T×T log scores, softmax over keys, apply to v.
    A row that sees no valid key outputs 0."""
    scores = hybrid_log_scores(q, k, log_q, log_k, window, sinks, key_valid, softcap, log_decay)
    return masked_softmax(scores).to(v.dtype) @ v


def _empty_state(q, v, log_k, dtype, mass_only: bool = False, group: int = 1) -> HybridState:
    b, h, _, m = log_k.shape
    linear = LinearState.zeros(b, h, m, 0 if mass_only else v.shape[-1], dtype, v.device)
    empty = lambda last, heads=h: q.new_zeros(b, heads, 0, last, dtype=dtype)  # noqa: E731
    none = torch.zeros(b, 0, dtype=torch.bool, device=q.device)
    kv = h // group
    return HybridState(linear, empty(q.shape[-1], kv), empty(v.shape[-1], kv), empty(m), none,
                       empty(q.shape[-1], kv), empty(v.shape[-1], kv), none, none)


def _linear_part(log_q, ctx_lk, ctx_v, lin_ok, state: HybridState, limit, first_sees: bool, shift=None):
    """Linear attention of the new rows over the state and the context keys that left their window:
    (total (B, H, C, dv+1) at row scale r, r, new LinearState without length). first_sees: limit[0] > 0.
    shift (B, H, n_b + C) or None: the gate's log decay of each context position counted from the
    last position the state saw (a row reads key j at exp(shift_i − shift_j), the state at exp(shift_i))."""
    leave, c = lin_ok.shape[1], log_q.shape[2]
    drop = ~lin_ok[:, None, :, None]
    lk = ctx_lk[:, :, :leave].masked_fill(drop, float("-inf"))
    if shift is not None:
        log_q, lk = log_q + shift[:, :, -c:, None], lk - shift[:, :, :leave, None]
    vals = torch.cat([ctx_v[:, :, :leave], ctx_v.new_ones(*ctx_v.shape[:2], leave, 1)], -1).masked_fill(drop, 0.0)
    kv1 = torch.cat([state.linear.kv, state.linear.k_sum[..., None]], dim=-1)
    total, r, kv1, offset = chunk_step(log_q, lk, vals, kv1, state.linear.offset, limit, first_sees=first_sees)
    if shift is not None:  # the state now stands at the chunk's last position
        kv1, offset = carry_decay(kv1, offset, shift[:, :, -1:])
    return total, r, LinearState(kv1[..., :-1], kv1[..., -1], offset, state.linear.length)


def _gate_shift(state: HybridState, log_decay: torch.Tensor):
    """(shift (B, H, n_b + C): the context's cumulative log decay counted from the last position the
    state saw, the context's log decays)."""
    n_b = state.k.shape[2]
    held = state.decay if state.decay is not None else log_decay.new_zeros(*log_decay.shape[:2], n_b)
    decays = torch.cat([held, log_decay], dim=-1)
    cumulative = decays.cumsum(-1)
    return (cumulative - cumulative[..., n_b - 1:n_b] if n_b else cumulative), decays


def _step(q, k, v, log_q, log_k, valid, state: HybridState, window: int, sinks: int, softcap=None, log_decay=None,
          far=None, group: int = 1):
    """New tokens (C of them) against [sinks ; window buffer ; new tokens]; returns (out, new state).
    ``far(log_q, v, log_k, v_leaving, keep, delta state) -> (ô (B, H, C, dv), delta state)`` reads the
    older tokens instead of the linear numerator (module docstring); log_k, v_leaving (B, H, L, ·) are
    the keys leaving the window, in order, keep (B, L) which of them are neither pads nor sinks.
    ``group``: query heads per KV head; the state's keys and values are the KV heads' (module docstring)."""
    n_b, c, dv = state.k.shape[2], q.shape[2], v.shape[-1]
    k, v_kv = k[:, ::group], v[:, ::group]  # one copy of each KV head's new keys and values (views)
    ctx_k, ctx_v, ctx_lk = (torch.cat([a, b], dim=2) for a, b in ((state.k, k), (state.v, v_kv), (state.log_k, log_k)))
    ctx_valid = torch.cat([state.valid, valid], dim=1)  # (B, n_b + C)
    seen = state.sink_valid.sum(-1) + state.is_sink.sum(-1)  # sinks so far: min(valid keys so far, sinks)
    ctx_sink = torch.cat([state.is_sink, _sink_keys(valid, sinks, seen)], dim=1)
    leave = max(0, n_b + c - window)  # tokens that fall out of the window after this step
    limit = (torch.arange(c, device=q.device) + n_b - window + 1).clamp(0, leave)
    lin_ok = ctx_valid[:, :leave] & ~ctx_sink[:, :leave]  # a sink stays exact, never linear
    first_sees = min(max(n_b - window + 1, 0), leave) > 0  # limit[0] > 0, known without the device
    shift, decays = (None, None) if log_decay is None else _gate_shift(state, log_decay)
    leaving_v = ctx_v[:, :, :leave]
    if group > 1:  # the linear part and the far reader read the leaving values per query head
        leaving_v = leaving_v.repeat_interleave(group, dim=1)
    total, r, linear = _linear_part(log_q, ctx_lk, leaving_v if far is None else leaving_v[..., :0], lin_ok, state,
                                    limit, first_sees, shift)
    delta = state.delta
    if far is not None:  # the far reader's output, weighted by the older keys' mass (total is that mass)
        read, delta = far(log_q, v, ctx_lk[:, :, :leave], leaving_v, lin_ok, delta)
        total = torch.cat([total * read.to(total.dtype), total], dim=-1)

    exact = _exact_mask(c, n_b + c, window, ctx_sink, q.device) & ctx_valid[:, None, :]
    keys, vals = ctx_k, ctx_v
    if state.sink_k.shape[2]:
        exact = torch.cat([state.sink_valid[:, None, :].expand(-1, c, -1), exact], dim=2)
        keys, vals = torch.cat([state.sink_k, ctx_k], dim=2), torch.cat([state.sink_v, ctx_v], dim=2)
    b, h = q.shape[:2]
    # (B, 1, G·C, S): the same for every head; a KV head's G query heads are its rows (head kv·G + g, row g·C + i)
    exact = exact[:, None, None].expand(-1, 1, group, -1, -1).reshape(b, 1, group * c, exact.shape[-1])
    s = exact_logits(q.reshape(b, h // group, group * c, -1), keys, softcap).masked_fill(~exact, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
    p = torch.exp(s - mx)
    near, p_sum, mx = ((p @ vals).reshape(b, h, c, -1), p.sum(-1, keepdim=True).reshape(b, h, c, 1),
                       mx.reshape(b, h, c, 1))
    top = torch.maximum(r, mx)  # flash-style merge of the two partial sums
    w_l, w_s = torch.exp(r - top), torch.exp(mx - top)
    num = w_l * total[..., :dv] + w_s * near
    den = w_l * total[..., dv:] + w_s * p_sum
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)

    linear.length = state.linear.length + leave
    held, done = (state.sink_k, state.sink_v, state.sink_valid), state.sinks_held
    if sinks and leave and not done:  # the bookkeeping reads the host: only while a sink can still leave
        held, done = _hold_sinks(state, ctx_k[:, :, :leave], ctx_v[:, :, :leave], ctx_sink[:, :leave], sinks)
    new = HybridState(linear, ctx_k[:, :, leave:], ctx_v[:, :, leave:], ctx_lk[:, :, leave:], ctx_valid[:, leave:],
                      *held, ctx_sink[:, leave:], done, None if decays is None else decays[:, :, leave:], delta)
    return out, new


def _hold_sinks(state: HybridState, k, v, leaving, sinks: int):
    """((sink_k, sink_v, sink_valid), all held) after the sinks among the keys leaving the window
    (k (B, H, L, d), v (B, H, L, dv), leaving (B, L) bool) join each row's next free slots, in order;
    ``all held``: every row now holds ``sinks`` sinks. One host read."""
    unchanged = (state.sink_k, state.sink_v, state.sink_valid)
    if leaving.shape[0] == 0:
        return unchanged, False
    held = state.sink_valid.sum(-1)
    count = held + leaving.sum(-1)
    any_leaving, fewest, most = torch.stack([leaving.any().long(), count.min(), count.max()]).tolist()
    if not any_leaving:
        return unchanged, fewest >= sinks
    size = max(state.sink_k.shape[2], most)
    slot = torch.where(leaving, held[:, None] + leaving.cumsum(-1) - 1, size)  # non-sinks: spare slot
    full = torch.arange(size, device=leaving.device)[None, :] < count[:, None]
    return (_scatter_slots(state.sink_k, slot, k, size), _scatter_slots(state.sink_v, slot, v, size), full), \
        fewest >= sinks


def _scatter_slots(buffer, slot, x, size: int) -> torch.Tensor:
    """buffer (B, H, s, D) grown to ``size`` slots with x[:, :, i] (B, H, L, D) written to slot[:, i]
    (B, L); slot ``size`` is a spare, dropped."""
    b, h, s, d = buffer.shape
    grown = torch.cat([buffer, buffer.new_zeros(b, h, size + 1 - s, d)], dim=2)
    index = slot[:, None, :, None].expand(b, h, slot.shape[1], d)
    return grown.scatter(2, index, x)[:, :, :size]


def hybrid_attention_chunked(
    q, k, v, log_q, log_k, window: int, chunk_size: int | None = None, state: HybridState | None = None,
    *, sinks: int = 0, key_valid: torch.Tensor | None = None, softcap: float | None = None,
    log_decay: torch.Tensor | None = None, far=None, group: int = 1,
) -> tuple[torch.Tensor, HybridState]:
    """Hybrid attention in chunks (default chunk = window); continues from ``state``.

    Work per chunk is O(C·(sinks + W + C)) for the exact part and O(C·M·dv) for the linear part;
    decoding one token at a time is the same call with T = 1. key_valid (B, T) bool marks the new
    tokens' real keys (False = padding); a row that sees no valid key outputs 0. ``softcap``
    caps the exact part's logits as the teacher does (Gemma 2); None = no capping. ``log_decay``
    (B, H, T) ≤ 0: the gate (module docstring; a pad does not decay the state); None = ungated.
    ``far``: a reader of the older tokens (module docstring, :func:`_step`); None = linear attention.
    ``group``: query heads per KV head in k and v (module docstring); 1 keeps every head's keys.
    """
    if window < 1:
        raise ValueError(f"window must be ≥ 1 for hybrid attention, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be a positive number (or None for no capping)")
    if sinks < 0:
        raise ValueError(f"sinks must be ≥ 0 (number of leading tokens kept exact), got {sinks}")
    if group < 1 or q.shape[1] % group:
        raise ValueError(f"group={group} must divide the {q.shape[1]} heads (query heads per KV head)")
    out_dtype, (b, _, t, _) = v.dtype, q.shape
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.promote_types(log_q.dtype, torch.float32))
    q, k, v, log_q, log_k = (x.to(dtype) for x in (q, k, v, log_q, log_k))
    if key_valid is None:
        key_valid = torch.ones(b, t, dtype=torch.bool, device=q.device)
    elif key_valid.shape != (b, t):
        raise ValueError(f"key_valid must be (B, T) = {(b, t)} bool for the new tokens; got {tuple(key_valid.shape)}")
    if log_decay is not None:
        if log_decay.shape != q.shape[:3]:
            raise ValueError(f"log_decay must be (B, H, T) = {tuple(q.shape[:3])}; got {tuple(log_decay.shape)}")
        log_decay = log_decay.to(dtype).masked_fill(~key_valid.to(torch.bool)[:, None, :], 0.0)
    state = _cast(state, dtype) if state is not None else _empty_state(q, v, log_k, dtype, far is not None, group)
    chunk = chunk_size or window
    outs = []
    for start in range(0, t, chunk):
        sl = slice(start, start + chunk)
        out, state = _step(q[:, :, sl], k[:, :, sl], v[:, :, sl], log_q[:, :, sl], log_k[:, :, sl],
                           key_valid[:, sl].to(torch.bool), state, window, sinks, softcap,
                           None if log_decay is None else log_decay[:, :, sl], far, group)
        outs.append(out)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.cat(outs, dim=2).to(out_dtype), state


def _cast(state: HybridState, dtype: torch.dtype) -> HybridState:
    f = lambda t: t.to(dtype)  # noqa: E731
    return HybridState(state.linear.to(dtype), f(state.k), f(state.v), f(state.log_k), state.valid,
                       f(state.sink_k), f(state.sink_v), state.sink_valid, state.is_sink, state.sinks_held,
                       None if state.decay is None else f(state.decay), None if state.delta is None else state.delta.to(dtype))
