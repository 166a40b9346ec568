"""The decay gate of gated linear attention: a per-head, per-token log decay a_t ≤ 0 from the values.

    a_t = −α_h · softplus(w_h · v_t + b_h),    α_h ≥ 0

The state then forgets as S_t = e^{a_t} S_{t−1} + φ(k_t) v_tᵀ (:mod:`dofla.attention.linear`). The
input is the layer's own value vector v_t (per query head, after GQA expansion): it carries the
token's content and no position (no RoPE), so the decay depends on what was read, not where.

α starts at 0, so a freshly gated student is exactly the ungated one (the layerwise stage's student)
and its KL starts where the ungated student's does. α's gradient at 0 is −softplus(·) times the
loss's gradient in a, which is non-zero, so it moves; a smooth map onto a ≤ 0 would have a zero
gradient at a = 0 and never leave it. α ≥ 0 is kept by projection: training calls :meth:`project_`
after each optimiser step (a negative α would make the state grow instead of decay).

Layouts: v (B, H, T, d) -> log decay (B, H, T).
"""
from __future__ import annotations

import torch
from torch import nn

GATES = ("none", "scalar")


class ScalarGate(nn.Module):
    """One decay per head and token (the module docstring's a_t); parameters w (H, d), b (H,), α (H,)."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads))
        self.alpha = nn.Parameter(torch.zeros(num_heads))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """v (B, H, T, d) -> log decay (B, H, T), ≤ 0 while α ≥ 0."""
        logits = torch.einsum("bhtd,hd->bht", v.float(), self.weight.float()) + self.bias.float()[:, None]
        return -self.alpha.float()[:, None] * nn.functional.softplus(logits)

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp α at 0 from below (after an optimiser step)."""
        self.alpha.clamp_(min=0.0)


def build_gate(name: str, num_heads: int, head_dim: int) -> ScalarGate | None:
    """The gate called ``name`` (one of :data:`GATES`; ``none`` -> None)."""
    if name not in GATES:
        raise ValueError(f"gate={name!r} is not one of {', '.join(GATES)}; pick one of them")
    return None if name == "none" else ScalarGate(num_heads, head_dim)


def project_gates(model) -> None:
    """Keep every gate of ``model`` a decay (α ≥ 0): call after each optimiser step that trains them."""
    for module in model.modules():
        if isinstance(module, ScalarGate):
            module.project_()
