"""Linear attention in O(T·M·dv): a chunked parallel form and a token-by-token recurrence.

Both keep a per-head state of fixed size: kv (M, dv) = Σ_j exp(log_k_j − c) v_jᵀ and
k_sum (M,) = Σ_j exp(log_k_j − c), with c (M,) the running per-feature maximum of the key log
features. Working relative to c keeps every key feature ≤ 1 (no overflow at PRF norms where
|x|²/sqrt(d) ≈ 140); queries read the state with exp(log_q + c − max_m(log_q + c)), whose
per-row shift cancels in numerator/denominator. c and the shift are detached: the output does
not depend on them, so gradients are exact.

Layouts: log_q, log_k (B, H, T, M); v (B, H, T, dv); outputs (B, H, T, dv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearState:
    """Recurrent state after ``length`` tokens. kv (B, H, M, dv), k_sum (B, H, M), offset (B, H, M).

    ``offset`` starts at the dtype's most negative finite value (not −inf) so that rescaling an
    empty state is exp(−huge) = 0 instead of NaN.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    offset: torch.Tensor
    length: int = 0

    @classmethod
    def zeros(
        cls, batch: int, heads: int, features: int, value_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> "LinearState":
        kv = torch.zeros(batch, heads, features, value_dim, dtype=dtype, device=device)
        k_sum = torch.zeros(batch, heads, features, dtype=dtype, device=device)
        offset = torch.full_like(k_sum, torch.finfo(dtype).min)
        return cls(kv, k_sum, offset, 0)

    def to(self, dtype: torch.dtype) -> "LinearState":
        if self.kv.dtype == dtype:
            return self
        return LinearState(self.kv.to(dtype), self.k_sum.to(dtype), self.offset.to(dtype), self.length)

    def detach(self) -> "LinearState":
        return LinearState(self.kv.detach(), self.k_sum.detach(), self.offset, self.length)

    def index_select(self, index: torch.Tensor) -> "LinearState":
        """Reorder/select batch rows (beam search)."""
        index = index.to(self.kv.device)
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return LinearState(pick(self.kv), pick(self.k_sum), pick(self.offset), self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.k_sum, self.offset))


def _prepare(log_q, log_k, v, state):
    """Check shapes, pick the compute dtype (≥ fp32: exp of shifted logs needs the mantissa),
    and create an empty state if none is given."""
    if log_q.shape != log_k.shape or log_k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"expected log_q, log_k (B, H, T, M) and v (B, H, T, dv); got {tuple(log_q.shape)}, "
            f"{tuple(log_k.shape)}, {tuple(v.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(log_q.dtype, v.dtype), torch.float32)
    b, h, _, m = log_k.shape
    if state is None:
        state = LinearState.zeros(b, h, m, v.shape[-1], dtype, v.device)
    return log_q.to(dtype), log_k.to(dtype), v.to(dtype), state.to(dtype)


def _advance(state: LinearState, key_max: torch.Tensor):
    """New offset max(c, key_max) (detached) and the factor exp(c_old − c_new) for the old sums."""
    offset = torch.maximum(state.offset, key_max).detach()
    return offset, torch.exp(state.offset - offset)


def _query_features(log_q: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """exp(log_q + c − max_m(log_q + c)): ≤ 1, and the largest query·key term is exactly 1."""
    u = log_q + offset
    shift = u.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(u.dtype).min)
    return torch.exp(u - shift)


def _chunk_step(log_q, log_k, v, state: LinearState):
    """One chunk of C tokens: (B, H, C, M), (B, H, C, M), (B, H, C, dv) -> (out, new state)."""
    offset, scale = _advance(state, log_k.amax(dim=2))
    kv = state.kv * scale[..., None]
    k_sum = state.k_sum * scale
    phi_k = torch.exp(log_k - offset[:, :, None, :])  # (B, H, C, M)
    phi_q = _query_features(log_q, offset[:, :, None, :])  # (B, H, C, M)
    scores = (phi_q @ phi_k.transpose(-1, -2)).tril()  # causal within the chunk, diagonal included
    num = phi_q @ kv + scores @ v
    den = (phi_q @ k_sum[..., None]).squeeze(-1) + scores.sum(-1)
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None]
    kv = kv + phi_k.transpose(-1, -2) @ v
    k_sum = k_sum + phi_k.sum(dim=2)
    return out, LinearState(kv, k_sum, offset, state.length + log_k.shape[2])


def linear_attention_chunked(
    log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor,
    chunk_size: int = 64, state: LinearState | None = None,
) -> tuple[torch.Tensor, LinearState]:
    """Causal linear attention, chunk by chunk; continues from ``state`` (None = empty).

    log_q, log_k (B, H, T, M); v (B, H, T, dv) -> out (B, H, T, dv) in v's dtype, final state.
    Any T ≥ 0 and chunk_size ≥ 1 (the last chunk may be partial).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    out_dtype, length = v.dtype, v.shape[2]
    log_q, log_k, v, state = _prepare(log_q, log_k, v, state)
    outs = []
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        out, state = _chunk_step(log_q[:, :, start:end], log_k[:, :, start:end], v[:, :, start:end], state)
        outs.append(out)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.cat(outs, dim=2).to(out_dtype), state


def linear_attention_recurrent(
    log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor, state: LinearState | None = None
) -> tuple[torch.Tensor, LinearState]:
    """The plain recurrence, one token at a time (decoding); same layouts as the chunked form.

    The state stays (B, H, M, dv) however many tokens have been seen.
    """
    out_dtype = v.dtype
    log_q, log_k, v, state = _prepare(log_q, log_k, v, state)
    tiny = torch.finfo(v.dtype).tiny
    outs = []
    for t in range(v.shape[2]):
        offset, scale = _advance(state, log_k[:, :, t])
        phi_k = torch.exp(log_k[:, :, t] - offset)  # (B, H, M)
        kv = state.kv * scale[..., None] + phi_k[..., None] * v[:, :, t, None, :]
        k_sum = state.k_sum * scale + phi_k
        phi_q = _query_features(log_q[:, :, t], offset)  # (B, H, M)
        num = torch.einsum("bhm,bhmv->bhv", phi_q, kv)
        den = (phi_q * k_sum).sum(-1)
        outs.append(num / den.clamp_min(tiny)[..., None])
        state = LinearState(kv, k_sum, offset, state.length + 1)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.stack(outs, dim=2).to(out_dtype), state
