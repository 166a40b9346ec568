"""The paper's trainable PRF (docs/method.md §3): Performer whose z (H×M×d) and α (H×M) are trained.

At initialisation it equals ``performer`` with the same seed (z drawn identically, α = 1), so
training starts exactly at Performer.
"""
from __future__ import annotations

import torch
from torch import nn

from dofla.feature_maps.base import FEATURE_MAPS
from dofla.feature_maps.performer import PerformerFeatureMap

ALPHA_PARAMS = ("log", "raw")
# Floor for α under the raw parameterisation: the log of a non-positive weight is undefined.
RAW_ALPHA_FLOOR = 1e-6


@FEATURE_MAPS.register("learned_prf")
class LearnedPRFFeatureMap(PerformerFeatureMap):
    """Trainable PRF. ``alpha_param``: "log" (α = exp(a), a init 0) or "raw" (α init 1,
    clamped to ≥ 1e-6 inside the log). Parameters: ``z`` (H, M, d), ``alpha_param`` (H, M)."""

    name = "learned_prf"
    trainable = True

    def __init__(
        self, num_heads: int, head_dim: int, num_features: int, seed: int = 0, alpha_param: str = "log"
    ):
        if alpha_param not in ALPHA_PARAMS:
            raise ValueError(f"alpha_param={alpha_param!r}; choose one of: {', '.join(ALPHA_PARAMS)}")
        super().__init__(num_heads, head_dim, num_features, seed)
        self.alpha_mode = alpha_param
        init = 0.0 if alpha_param == "log" else 1.0  # both mean α = 1
        self.alpha_param = nn.Parameter(torch.full((num_heads, num_features), init))

    def _init_directions(self, z: torch.Tensor) -> None:
        self.z = nn.Parameter(z)

    def log_alpha(self) -> torch.Tensor:
        if self.alpha_mode == "log":
            return self.alpha_param
        return self.alpha_param.clamp_min(RAW_ALPHA_FLOOR).log()

    def alpha(self) -> torch.Tensor:
        """The positive feature weights α, (H, M)."""
        return self.log_alpha().exp()

    def param_groups(self) -> list[dict]:
        """Optimizer groups so z and α can take different learning rates (paper: 0.02 and 0.2)."""
        return [{"params": [self.z], "name": "z"}, {"params": [self.alpha_param], "name": "alpha"}]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha_param={self.alpha_mode}"
