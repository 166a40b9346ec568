"""Hedgehog feature maps: a trainable per-head projection y = x W (+ b), then softmaxes of ±y.

``hedgehog`` is the form of the Hedgehog paper (Zhang et al., ICLR 2024) and LoLCATs:
y = x W + b with W (d × d'), identity-initialised, and a zero-initialised bias b (d'), and

    φ(x) = [softmax(y), softmax(−y)]      (two separate softmaxes over d' entries each),

so M = 2 d' features and φ(q)·φ(k) = Σ_i softmax(y_q)_i softmax(y_k)_i + Σ_i softmax(−y_q)_i
softmax(−y_k)_i. Each half sums to 1 per token. For odd M the first softmax gets ⌈M/2⌉ entries
(all of y) and the second ⌊M/2⌋ (the first ⌊M/2⌋ entries of −y), so every M ≥ 1 is valid; M = 1
is a single constant feature (uniform attention). W has d' = ⌈M/2⌉ columns: the identity on the
first min(d, d') and seeded N(0, 0.02²) noise beyond d, so M need not be 2d.

``hedgehog_joint`` is this project's earlier form (fla's variant): no bias and ONE softmax over the
concatenation [y, −y[:⌊M/2⌋]]. The joint normaliser couples the halves: a token's mass is split
between them, so at large |y| a token whose largest |y_i| is a positive y_i has almost no mass on the
−y half; in the published form each half has mass 1 for every token. In the joint form 1/Z(q)
cancels in each attention row's normalisation but the key's 1/Z(k) stays as a per-key weight; in
the published form the per-half normalisers weight the two halves' kernels separately.

Both return log features (B, H, T, M): the published form is the concatenation of two
log_softmaxes, the joint form one log_softmax.
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
    """Published Hedgehog. Parameters ``weight`` (H, d, d') and ``bias`` (H, d'), d' = ⌈M/2⌉."""

    name = "hedgehog"
    trainable = True

    def __init__(
        self, num_heads: int, head_dim: int, num_features: int, seed: int = 0, init_std: float = 0.02
    ):
        super().__init__(num_heads, head_dim, num_features, seed)
        self.half = math.ceil(num_features / 2)
        self.weight = nn.Parameter(identity_like(num_heads, head_dim, self.half, seed, init_std))
        self.bias = nn.Parameter(torch.zeros(num_heads, self.half))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M): [log_softmax(y), log_softmax(−y[..., :M − d'])]."""
        x = compute_dtype(x)
        y = torch.einsum("bhtd,hdm->bhtm", x, self.weight.to(x.dtype))
        y = y + self.bias.to(x.dtype)[:, None, :]
        rest = self.num_features - self.half
        return torch.cat([torch.log_softmax(y, dim=-1), torch.log_softmax(-y[..., :rest], dim=-1)], dim=-1)


@FEATURE_MAPS.register("hedgehog_joint")
class HedgehogJointFeatureMap(FeatureMap):
    """Joint-softmax Hedgehog (no bias). Parameter ``weight`` (H, d, d'), d' = ⌈M/2⌉."""

    name = "hedgehog_joint"
    trainable = True

    def __init__(
        self, num_heads: int, head_dim: int, num_features: int, seed: int = 0, init_std: float = 0.02
    ):
        super().__init__(num_heads, head_dim, num_features, seed)
        self.half = math.ceil(num_features / 2)
        self.weight = nn.Parameter(identity_like(num_heads, head_dim, self.half, seed, init_std))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M): log_softmax([y, −y[..., :M − d']]) over all M entries."""
        x = compute_dtype(x)
        y = torch.einsum("bhtd,hdm->bhtm", x, self.weight.to(x.dtype))
        both = torch.cat([y, -y[..., : self.num_features - self.half]], dim=-1)
        return torch.log_softmax(both, dim=-1)
