"""Positive random features (Performer, "PRF"), docs/method.md §2.

log φ(x; z_m) = z_m·x / d^{1/4} − |x|² / (2 sqrt(d)) + ½ log(α_m / M), so that
Φ(x)·Φ(y) = (1/M) Σ_m α_m φ(x; z_m) φ(y; z_m) is, for α = 1 and z ~ N(0, I_d), an unbiased
estimate of exp(x·y / sqrt(d)). The formula lives in :func:`prf_log_features` and is shared with
the trainable ``learned_prf`` map.
"""
from __future__ import annotations

import math

import torch

from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Upcast half precision inputs: log features feed exp() after a max shift, where bf16's
    8-bit mantissa would already lose the kernel's ratios."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def draw_prf_directions(num_heads: int, num_features: int, head_dim: int, seed: int) -> torch.Tensor:
    """z ~ N(0, I_d), layout (H, M, d), float32 on CPU, reproducible from ``seed`` alone."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn(num_heads, num_features, head_dim, generator=generator)


def prf_log_features(
    x: torch.Tensor, z: torch.Tensor, log_alpha: torch.Tensor | None = None
) -> torch.Tensor:
    """log Φ(x): x (B, H, T, d), z (H, M, d), log_alpha (H, M) or None (α = 1) -> (B, H, T, M).

    One matrix product plus two in-place passes: the 1/d^{1/4} scale is folded into z, and
    ½ log(α/M) into one (H, 1, M) bias (both tiny). Autograd-safe: the product's backward does
    not need its output. :func:`prf_log_features_reference` is the formula written out.
    """
    x = compute_dtype(x)
    d, m = x.shape[-1], z.shape[1]
    bias = torch.full((z.shape[0], 1, m), -0.5 * math.log(m), dtype=x.dtype, device=x.device)
    if log_alpha is not None:
        bias = bias + 0.5 * log_alpha.to(x.dtype)[:, None, :]
    out = torch.matmul(x, (z.to(x.dtype) / d**0.25).transpose(-1, -2))
    if torch.is_grad_enabled() and x.requires_grad:
        sq_norm = x.square().sum(-1, keepdim=True)  # the norm's gradient is NaN at x = 0
    else:
        sq_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()  # one read of x
    return out.sub_(sq_norm.mul_(0.5 / math.sqrt(d))).add_(bias)


def prf_log_features_reference(
    x: torch.Tensor, z: torch.Tensor, log_alpha: torch.Tensor | None = None
) -> torch.Tensor:
    """The formula of the module docstring, term by term (tests compare the fast form with it)."""
    x = compute_dtype(x)
    d, m = x.shape[-1], z.shape[1]
    proj = torch.einsum("bhtd,hmd->bhtm", x, z.to(x.dtype)) / d**0.25
    out = proj - x.pow(2).sum(-1, keepdim=True) / (2.0 * math.sqrt(d)) - 0.5 * math.log(m)
    if log_alpha is not None:
        out = out + 0.5 * log_alpha.to(x.dtype)[:, None, :]
    return out


@FEATURE_MAPS.register("performer")
class PerformerFeatureMap(FeatureMap):
    """Plain Performer: fixed random z (buffer, H×M×d), α = 1, nothing trainable."""

    name = "performer"
    trainable = False

    def __init__(self, num_heads: int, head_dim: int, num_features: int, seed: int = 0):
        super().__init__(num_heads, head_dim, num_features, seed)
        self._init_directions(draw_prf_directions(num_heads, num_features, head_dim, seed))

    def _init_directions(self, z: torch.Tensor) -> None:
        """Hook: a buffer here (saved in the state dict, never trained); learned_prf overrides."""
        self.register_buffer("z", z)

    def log_alpha(self) -> torch.Tensor | None:
        """log α (H, M); None means α = 1."""
        return None

    @torch.no_grad()
    def redraw(self, seed: int) -> None:
        """Replace z by a fresh draw from ``seed`` (same seed -> same z)."""
        self.seed = seed
        z = draw_prf_directions(self.num_heads, self.num_features, self.head_dim, seed)
        self.z.copy_(z.to(self.z))

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> (B, H, T, M)."""
        return prf_log_features(x, self.z, self.log_alpha())
