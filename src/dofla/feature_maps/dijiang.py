"""DiJiang (Chen et al., ICML 2024), paper form (docs/method.md §6).

φ(x)_m = D_m · exp(t_m · (C x)_{m mod d} / d^{1/4}), C the orthonormal DCT-II matrix (d×d),
t_m = Φ⁻¹(u_m) with u_m ~ U(0, 1) (a deterministic, seeded draw), D > 0 learnable per head
(log-parameterised, init 1/sqrt(M)). There is no |x|² term. Feature m uses DCT row m mod d,
so any M works (rows cycle when M > d).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap
from dofla.feature_maps.performer import compute_dtype

# Keep u away from 0 and 1 where Φ⁻¹ is infinite.
_U_EPS = 1e-6


def dct_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal DCT-II matrix (d, d): C[k, n] = s_k cos(π (2n + 1) k / (2d)); C Cᵀ = I."""
    k = torch.arange(d, dtype=torch.float64)[:, None]
    n = torch.arange(d, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (2 * n + 1) * k / (2 * d)) * math.sqrt(2.0 / d)
    c[0] = c[0] / math.sqrt(2.0)
    return c.to(dtype)


@FEATURE_MAPS.register("dijiang")
class DiJiangFeatureMap(FeatureMap):
    """Buffers: ``dct`` (d, d), ``t`` (H, M), ``rows`` (M,) DCT row per feature.
    Parameter: ``log_d`` (H, M), log of the positive weights D."""

    name = "dijiang"
    trainable = True

    def __init__(self, num_heads: int, head_dim: int, num_features: int, seed: int = 0):
        super().__init__(num_heads, head_dim, num_features, seed)
        generator = torch.Generator().manual_seed(int(seed))
        u = torch.rand(num_heads, num_features, generator=generator, dtype=torch.float64)
        t = torch.special.ndtri(u.clamp(_U_EPS, 1.0 - _U_EPS))
        self.register_buffer("dct", dct_matrix(head_dim, torch.float32))
        self.register_buffer("t", t.float())
        self.register_buffer("rows", torch.arange(num_features) % head_dim, persistent=False)
        self.log_d = nn.Parameter(torch.full((num_heads, num_features), -0.5 * math.log(num_features)))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M)."""
        x = compute_dtype(x)
        cx = x @ self.dct.to(x.dtype).T  # (B, H, T, d): C x for every token
        cx = cx[..., self.rows]  # (B, H, T, M)
        t = self.t.to(x.dtype)[:, None, :]  # (H, 1, M)
        return self.log_d.to(x.dtype)[:, None, :] + t * cx / x.shape[-1] ** 0.25
