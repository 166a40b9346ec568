"""Feature maps φ: (B, H, T, d) -> (B, H, T, M), returned in log space.

Every map here is positive, so it returns ``log φ(x)`` (including any per-feature weight such as
the PRF's sqrt(α/M)); the attention kernels exponentiate after subtracting a running max, which
is what keeps PRF features finite at realistic query/key norms.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dofla.registry import Registry

FEATURE_MAPS: Registry[type["FeatureMap"]] = Registry("feature map")


class FeatureMap(nn.Module):
    """Base class: per-head feature map with its own output dimension ``num_features`` (M).

    Subclasses implement :meth:`log_features`. ``x`` is a query or key in layout (B, H, T, d)
    already scaled so that the teacher kernel is exp(q·k / sqrt(d)).
    """

    name: ClassVar[str]
    positive: ClassVar[bool] = True
    trainable: ClassVar[bool] = True

    def __init__(self, num_heads: int, head_dim: int, num_features: int, seed: int = 0):
        super().__init__()
        if num_heads < 1 or head_dim < 1 or num_features < 1:
            raise ValueError(
                f"feature map needs positive sizes, got num_heads={num_heads}, "
                f"head_dim={head_dim}, num_features={num_features}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_features = num_features
        self.seed = seed

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M): log φ(x)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Plain features φ(x) (can over/underflow at large norms; references and tests only)."""
        return self.log_features(x).exp()

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, features={self.num_features}"


def build_feature_map(
    name: str, num_heads: int, head_dim: int, num_features: int, **options
) -> FeatureMap:
    """Build a registered feature map by name."""
    return FEATURE_MAPS.get(name)(num_heads, head_dim, num_features, **options)
