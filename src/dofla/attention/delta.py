"""The gated delta rule (Yang, Kautz, Hatamizadeh, ICLR 2025) in three forms: a plain per-token
recurrence (the reference), a chunked form for training and prefill, and a one-token step for decoding.

Per head the state S ∈ ℝ^{M×dv} maps unit keys to values:

    S_t = α_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,      o_t = S_tᵀ q̂_t

α_t ∈ (0, 1] forgets, β_t ∈ [0, 1] is the write strength: the row of S along k̂_t moves a fraction β_t
of the way from what S already returns for k̂_t (α_t S_{t−1}ᵀ k̂_t) to v_t. Written with the
correction u_t = β_t (v_t − α_t S_{t−1}ᵀ k̂_t), the update is S_t = α_t S_{t−1} + k̂_t u_tᵀ.

The gate enters as log α (B, H, T) ≤ 0, so a chunk's decays are sums, not products: every factor the
chunked form uses is exp(g_t − g_s) with t ≥ s (g the cumulative log decay inside the chunk), ≤ 1,
and none is ever divided by. log α is clamped at :data:`LOG_ALPHA_MIN` (a state term e^{−60} below
the rest is lost in any float anyway) so that a chunk's cumulative sums stay finite.

Chunked (the WY/UT form): inside a chunk of C tokens starting from the state S₀, with
Γ_t = exp(g_t) and D_ts = exp(g_t − g_s), the corrections solve a unit lower-triangular system

    (I + A) U = diag(β) V − diag(βΓ) K S₀,   A_ts = β_t (k̂_t·k̂_s) D_ts for s < t,

so U = Ũ − W S₀ with [W | Ũ] = (I + A)⁻¹ [diag(βΓ) K | diag(β) V], solved for every chunk at once
(one batched triangular solve). The sequential part is three small products per chunk:
U = Ũ − W S₀, O = diag(Γ) Q S₀ + (QKᵀ ⊙ D, causal) U, S_C = Γ_C S₀ + (K ⊙ D_{C·})ᵀ U.

Padding: a key with ``key_valid`` False gets β = 0 and log α = 0, so it writes nothing and does not
decay the state. GQA: keys and values expanded to the query heads before the call.

The kernels take the unit keys k̂ and the queries q̂ as they are (any sign: the identity map is
allowed); :func:`unit_features` turns a feature map's log features into them. ‖k̂‖ = 1 and
β ∈ [0, 1] make every I − β k̂ k̂ᵀ a contraction, which is what keeps the state bounded.

Layouts: q, k (B, H, T, M); v (B, H, T, dv); log_alpha, beta (B, H, T); outputs (B, H, T, dv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_ALPHA_MIN = -60.0


@dataclass
class DeltaState:
    """The recurrent state after ``length`` tokens: S (B, H, M, dv), fixed in size."""

    S: torch.Tensor
    length: int = 0

    @classmethod
    def zeros(cls, batch: int, heads: int, features: int, value_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> "DeltaState":
        return cls(torch.zeros(batch, heads, features, value_dim, dtype=dtype, device=device), 0)

    def to(self, dtype: torch.dtype) -> "DeltaState":
        return self if self.S.dtype == dtype else DeltaState(self.S.to(dtype), self.length)

    def detach(self) -> "DeltaState":
        return DeltaState(self.S.detach(), self.length)

    def index_select(self, index: torch.Tensor) -> "DeltaState":
        """Reorder/select batch rows (beam search)."""
        return DeltaState(self.S.index_select(0, index.to(self.S.device)), self.length)

    def nbytes(self) -> int:
        return self.S.numel() * self.S.element_size()


def unit_features(log_x: torch.Tensor) -> torch.Tensor:
    """φ(x)/‖φ(x)‖ from log φ(x) (..., M), without forming φ(x): exp(log φ − ½ log Σ φ²)."""
    return torch.exp(log_x - 0.5 * torch.logsumexp(2.0 * log_x, dim=-1, keepdim=True))


def _prepare(q, k, v, log_alpha, beta, state, key_valid):
    """Check shapes, pick the compute dtype (≥ fp32), clamp log α, mask padding (β = 0, log α = 0,
    k̂ = v = 0) and create an empty state. Returns (q, k, v, log_alpha, beta, state)."""
    if q.shape != k.shape or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected q, k (B, H, T, M) and v (B, H, T, dv); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for name, x in (("log_alpha", log_alpha), ("beta", beta)):
        if x.shape != k.shape[:3]:
            raise ValueError(f"{name} must be (B, H, T) = {tuple(k.shape[:3])}; got {tuple(x.shape)}")
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    b, h, t, m = k.shape
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    log_alpha = log_alpha.to(dtype).clamp_min(LOG_ALPHA_MIN)
    if key_valid is not None:
        if key_valid.shape != (b, t):
            raise ValueError(f"key_valid must be (B, T) = {(b, t)} bool for the new tokens; "
                             f"got {tuple(key_valid.shape)}")
        pad = ~key_valid.to(torch.bool)[:, None, :]
        beta, log_alpha = beta.masked_fill(pad, 0.0), log_alpha.masked_fill(pad, 0.0)
        k, v = k.masked_fill(pad[..., None], 0.0), v.masked_fill(pad[..., None], 0.0)
    state = DeltaState.zeros(b, h, m, v.shape[-1], dtype, v.device) if state is None else state.to(dtype)
    return q, k, v, log_alpha, beta, state


def delta_rule_naive(q, k, v, log_alpha, beta, state: DeltaState | None = None, *,
                     key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, DeltaState]:
    """The reference: the module docstring's recurrence token by token, with I − β k̂ k̂ᵀ formed as an
    (M, M) matrix. For tests and small inputs."""
    out_dtype, t = v.dtype, v.shape[2]
    q, k, v, log_alpha, beta, state = _prepare(q, k, v, log_alpha, beta, state, key_valid)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    S, outs = state.S, []
    for i in range(t):
        kt, bt, at = k[:, :, i], beta[:, :, i, None, None], torch.exp(log_alpha[:, :, i])[..., None, None]
        erase = eye - bt * kt[..., :, None] * kt[..., None, :]  # (B, H, M, M)
        S = at * (erase @ S) + bt * kt[..., :, None] * v[:, :, i, None, :]
        outs.append((S.transpose(-1, -2) @ q[:, :, i, :, None])[..., 0])
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.to(out_dtype), DeltaState(S, state.length + t)


def delta_rule_recurrent(q, k, v, log_alpha, beta, state: DeltaState | None = None, *,
                         key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, DeltaState]:
    """Decoding: one token at a time in the correction form S ← αS + k̂ uᵀ, u = β(v − αSᵀk̂);
    O(M·dv) per token and head whatever the context. Same layouts as the other forms."""
    out_dtype, t = v.dtype, v.shape[2]
    q, k, v, log_alpha, beta, state = _prepare(q, k, v, log_alpha, beta, state, key_valid)
    S, outs = state.S, []
    for i in range(t):
        kt = k[:, :, i]
        S = torch.exp(log_alpha[:, :, i])[..., None, None] * S
        u = beta[:, :, i, None] * (v[:, :, i] - torch.einsum("bhm,bhmv->bhv", kt, S))
        S = S + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhm,bhmv->bhv", q[:, :, i], S))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.to(out_dtype), DeltaState(S, state.length + t)


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, T, ...) zero-padded to whole chunks -> (B, H, N, C, ...). Zero β and log α make a pad
    inert, zero k and v keep it finite."""
    extra = -x.shape[2] % chunk
    if extra:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, extra))
    return x.view(*x.shape[:2], -1, chunk, *x.shape[3:])


def chunk_operators(q, k, v, log_alpha, beta, chunk: int):
    """Everything of every chunk that does not depend on the carried state, for all chunks at once.

    Returns (W (B, H, N, C, M), Ũ (B, H, N, C, dv), P (B, H, N, C, C), qΓ (B, H, N, C, M),
    kD (B, H, N, C, M), Γ_C (B, H, N)): U = Ũ − W S₀; O = qΓ S₀ + P U; S_C = Γ_C S₀ + kDᵀ U.
    """
    qc, kc, vc = _chunks(q, chunk), _chunks(k, chunk), _chunks(v, chunk)
    g = _chunks(log_alpha, chunk).cumsum(-1)  # (B, H, N, C)
    bc = _chunks(beta, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril_()
    # D_ts = exp(g_t − g_s) on and below the diagonal (≤ 1), 0 above: masked before exp, no inf·0
    decay = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")))
    a = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
    system = torch.eye(chunk, dtype=q.dtype, device=q.device) + a.tril(-1)  # unit lower-triangular
    gamma = torch.exp(g)
    rhs = torch.cat([(bc * gamma)[..., None] * kc, bc[..., None] * vc], dim=-1)  # (B, H, N, C, M + dv)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    m = k.shape[-1]
    last = g[..., -1:]  # (B, H, N, 1): the chunk's total log decay
    kd = kc * torch.exp(last - g)[..., None]
    return solved[..., :m], solved[..., m:], (qc @ kc.transpose(-1, -2)) * decay, qc * gamma[..., None], kd, \
        torch.exp(last[..., 0])


def delta_rule_chunked(q, k, v, log_alpha, beta, chunk_size: int = 64, state: DeltaState | None = None, *,
                       key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, DeltaState]:
    """The gated delta rule chunk by chunk (module docstring); continues from ``state`` (None: empty).

    Any T ≥ 0 and chunk_size ≥ 1 (the last chunk is padded with inert tokens). key_valid (B, T) bool
    marks the new tokens' real keys. Returns the outputs in v's dtype and the final state.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    out_dtype, t = v.dtype, v.shape[2]
    q, k, v, log_alpha, beta, state = _prepare(q, k, v, log_alpha, beta, state, key_valid)
    if t == 0:
        return v.new_zeros(v.shape).to(out_dtype), state
    chunk = min(chunk_size, t)
    w, u0, p, qg, kd, total = chunk_operators(q, k, v, log_alpha, beta, chunk)
    S, outs = state.S, []
    for c in range(w.shape[2]):
        u = u0[:, :, c] - w[:, :, c] @ S  # (B, H, C, dv): this chunk's corrections
        outs.append(qg[:, :, c] @ S + p[:, :, c] @ u)
        S = total[:, :, c, None, None] * S + kd[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :t]
    return out.to(out_dtype), DeltaState(S, state.length + t)
