"""1 + ELU features (Katharopoulos et al., 2020) after a learnable projection P (H×d×M).

P starts as the identity on the first min(d, M) coordinates (seeded small random columns
beyond d), so at initialisation φ(x) = 1 + elu(x) for M = d.
"""
from __future__ import annotations

import torch
from torch import nn

from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap
from dofla.feature_maps.hedgehog import identity_like
from dofla.feature_maps.performer import compute_dtype


def log_one_plus_elu(y: torch.Tensor) -> torch.Tensor:
    """log(1 + elu(y)) without forming 1 + elu: it is y for y < 0 and log1p(y) for y ≥ 0.

    The clamp keeps log1p's unused branch finite so torch.where does not leak NaN gradients.
    """
    return torch.where(y < 0, y, torch.log1p(y.clamp_min(0)))


@FEATURE_MAPS.register("elu1")
class Elu1FeatureMap(FeatureMap):
    """Parameter ``proj`` (H, d, M)."""

    name = "elu1"
    trainable = True

    def __init__(
        self, num_heads: int, head_dim: int, num_features: int, seed: int = 0, init_std: float = 0.02
    ):
        super().__init__(num_heads, head_dim, num_features, seed)
        self.proj = nn.Parameter(identity_like(num_heads, head_dim, num_features, seed, init_std))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M)."""
        x = compute_dtype(x)
        return log_one_plus_elu(torch.einsum("bhtd,hdm->bhtm", x, self.proj.to(x.dtype)))
