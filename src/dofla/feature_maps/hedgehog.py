"""Hedgehog (Zhang et al., 2024): trainable linear map per head, then softmax over [xW, −xW].

With M1 = ceil(M/2): features = softmax([xW, −xW[..., :M − M1]]) along the feature axis, so
there are exactly M features for any M ≥ 1. Returned as log_softmax (log features).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap
from dofla.feature_maps.performer import compute_dtype


def identity_like(num_heads: int, head_dim: int, width: int, seed: int, std: float) -> torch.Tensor:
    """(H, d, width): identity on the first min(d, width) columns, seeded N(0, std²) beyond d,
    so the map starts as (a truncation of) the input itself."""
    generator = torch.Generator().manual_seed(int(seed))
    w = torch.randn(num_heads, head_dim, width, generator=generator) * std
    n = min(head_dim, width)
    w[:, :, :n] = torch.eye(head_dim, n).expand(num_heads, head_dim, n)
    return w


@FEATURE_MAPS.register("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """Parameter ``weight`` (H, d, M1), M1 = ceil(M / 2)."""

    name = "hedgehog"
    trainable = True

    def __init__(
        self, num_heads: int, head_dim: int, num_features: int, seed: int = 0, init_std: float = 0.02
    ):
        super().__init__(num_heads, head_dim, num_features, seed)
        self.half = math.ceil(num_features / 2)
        self.weight = nn.Parameter(identity_like(num_heads, head_dim, self.half, seed, init_std))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M)."""
        x = compute_dtype(x)
        y = torch.einsum("bhtd,hdm->bhtm", x, self.weight.to(x.dtype))
        both = torch.cat([y, -y[..., : self.num_features - self.half]], dim=-1)
        return torch.log_softmax(both, dim=-1)
