"""Hybrid attention: exact softmax over the last W tokens, linear attention for everything older.

Query i attends with the softmax kernel exp(q_i·k_j/sqrt(d)) to keys i−W < j ≤ i and with the
learned kernel K̂(q_i, k_j) = Φ(q_i)·Φ(k_j) to keys j ≤ i−W, normalised together:

    y_i = (Σ_window e^{s_ij} v_j + Σ_older K̂_ij v_j) / (Σ_window e^{s_ij} + Σ_older K̂_ij)

PRF-type features estimate the same kernel, so both parts share one scale. W = 0 is pure linear
attention (the paper's setting). Decoding keeps the last W keys/values plus the linear state of
the older tokens: memory O(W + M·dv) per head, not O(T).

Layouts: q, k (B, H, T, d) with q scaled so the kernel is exp(q·k/sqrt(d)); v (B, H, T, dv);
log_q, log_k (B, H, T, M) feature-map log features. Keys/values already expanded to H heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dofla.attention.linear import LinearState, _advance, _query_features
from dofla.attention.naive import log_kernel_matrix


@dataclass
class HybridState:
    """Linear state of tokens older than the window, plus the window's last ≤ W keys/values."""

    linear: LinearState
    k: torch.Tensor  # (B, H, n, d)
    v: torch.Tensor  # (B, H, n, dv)
    log_k: torch.Tensor  # (B, H, n, M)

    @property
    def length(self) -> int:
        return self.linear.length + self.k.shape[2]

    def index_select(self, index: torch.Tensor) -> "HybridState":
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        return HybridState(self.linear.index_select(index), pick(self.k), pick(self.v), pick(self.log_k))

    def nbytes(self) -> int:
        return self.linear.nbytes() + sum(t.numel() * t.element_size() for t in (self.k, self.v, self.log_k))


def hybrid_log_scores(q, k, log_q, log_k, window: int) -> torch.Tensor:
    """The quadratic reference's (B, H, T, T) log-kernel matrix: softmax inside the window,
    log K̂ outside it, −inf above the diagonal."""
    t = q.shape[2]
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    scores = torch.where(
        j > i - window, (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), log_kernel_matrix(log_q, log_k)
    )
    return scores.masked_fill(j > i, float("-inf"))


def hybrid_attention_naive(q, k, v, log_q, log_k, window: int) -> torch.Tensor:
    """Quadratic reference: materialise the T×T log scores, softmax over keys, apply to v."""
    return torch.softmax(hybrid_log_scores(q, k, log_q, log_k, window), dim=-1) @ v


def _empty_state(q, v, log_k) -> HybridState:
    b, h, _, m = log_k.shape
    linear = LinearState.zeros(b, h, m, v.shape[-1], torch.float32, v.device)
    empty = lambda last: q.new_zeros(b, h, 0, last)  # noqa: E731
    return HybridState(linear, empty(q.shape[-1]), empty(v.shape[-1]), empty(m))


def _step(q, k, v, log_q, log_k, state: HybridState, window: int):
    """New tokens (C of them) against [window buffer ; new tokens]; returns (out, new state)."""
    n_b, c = state.k.shape[2], q.shape[2]
    ctx_k = torch.cat([state.k, k], dim=2)  # (B, H, n_b + C, d)
    ctx_v = torch.cat([state.v, v], dim=2)
    ctx_lk = torch.cat([state.log_k, log_k], dim=2)
    a = torch.arange(c, device=q.device)[:, None] + n_b  # query position inside the context
    t = torch.arange(n_b + c, device=q.device)[None, :]
    in_window = (t <= a) & (t > a - window)
    is_older = t <= a - window

    offset, scale = _advance(state.linear, ctx_lk.amax(dim=2))
    kv, k_sum = state.linear.kv * scale[..., None], state.linear.k_sum * scale
    u = log_q + offset[:, :, None, :]
    r = u.detach().amax(-1, keepdim=True)  # linear part's row scale: K̂ = e^r · φq·φk
    phi_q = _query_features(log_q, offset[:, :, None, :])
    phi_k = torch.exp(ctx_lk - offset[:, :, None, :])
    lin = (phi_q @ phi_k.transpose(-1, -2)) * is_older
    num_l, den_l = phi_q @ kv + lin @ ctx_v, (phi_q @ k_sum[..., None]).squeeze(-1) + lin.sum(-1)

    s = (q @ ctx_k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~in_window, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True)  # the window always holds the query's own key
    p = torch.exp(s - mx)
    num_s, den_s = p @ ctx_v, p.sum(-1)

    top = torch.maximum(r, mx)
    w_l, w_s = torch.exp(r - top), torch.exp(mx - top)
    num = w_l * num_l + w_s * num_s
    den = w_l.squeeze(-1) * den_l + w_s.squeeze(-1) * den_s
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None]

    keep = min(window, n_b + c)
    leave = n_b + c - keep  # tokens that fall out of the window join the linear state
    kv = kv + phi_k[:, :, :leave].transpose(-1, -2) @ ctx_v[:, :, :leave]
    k_sum = k_sum + phi_k[:, :, :leave].sum(dim=2)
    linear = LinearState(kv, k_sum, offset, state.linear.length + leave)
    return out, HybridState(linear, ctx_k[:, :, leave:], ctx_v[:, :, leave:], ctx_lk[:, :, leave:])


def hybrid_attention_chunked(
    q, k, v, log_q, log_k, window: int, chunk_size: int | None = None, state: HybridState | None = None
) -> tuple[torch.Tensor, HybridState]:
    """Hybrid attention in chunks (default chunk = window); continues from ``state``.

    Work per chunk is O(C·(W + C)) for the window and O(C·M·dv) for the linear part; decoding
    one token at a time is the same call with T = 1.
    """
    if window < 1:
        raise ValueError(f"window must be ≥ 1 for hybrid attention, got {window}")
    out_dtype = v.dtype
    q, k, v, log_q, log_k = (x.float() for x in (q, k, v, log_q, log_k))
    state = state or _empty_state(q, v, log_k)
    chunk = chunk_size or window
    outs = []
    for start in range(0, q.shape[2], chunk):
        sl = slice(start, start + chunk)
        out, state = _step(q[:, :, sl], k[:, :, sl], v[:, :, sl], log_q[:, :, sl], log_k[:, :, sl], state, window)
        outs.append(out)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.cat(outs, dim=2).to(out_dtype), state
