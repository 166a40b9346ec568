"""Allocation policies: per-layer feature dimensions under a fixed budget (mean dim = C)."""
from __future__ import annotations

import math
from typing import Callable

from dofla.registry import Registry

Policy = Callable[[list[float], float, int], list[int]]
ALLOCATION_POLICIES: Registry[Policy] = Registry("allocation policy")
# Policies that give every (layer, head) its own dim, from Algorithm 1's per-head DoF.
PER_HEAD_POLICIES = ("dof_head",)


@ALLOCATION_POLICIES.register("fix")
def allocate_fix(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """The budget in every layer (the paper's baseline: C = head size)."""
    return [max(1, round(budget))] * len(layer_dof)


@ALLOCATION_POLICIES.register("dof")
def allocate_dof(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """Algorithm 1: M_s = round(t⁻¹·N_s) with t⁻¹ = C / mean(N) (plain rounding, mean ≈ C)."""
    mean = sum(layer_dof) / len(layer_dof)
    if mean <= 0:
        raise ValueError("every layer has zero degrees of freedom; dof allocation is undefined")
    scale = budget / mean
    return [max(1, round(scale * n)) for n in layer_dof]


@ALLOCATION_POLICIES.register("dof_clip")
def allocate_dof_clip(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """Algorithm 1, then each layer capped at the head size (cheaper than dof)."""
    return [min(m, head_dim) for m in allocate_dof(layer_dof, budget, head_dim)]


def allocate_dims(layer_dof: list[float], budget: int | float, policy: str, head_dim: int) -> list[int]:
    """Per-layer feature dims (one int per layer) for ``policy`` (fix | dof | dof_clip).

    ``budget`` is C, the mean feature dimension per layer; ``head_dim`` caps ``dof_clip``.
    """
    policy_fn = ALLOCATION_POLICIES.get(policy)  # unknown names fail first, listing the valid ones
    if not layer_dof:
        raise ValueError("layer_dof is empty; run Algorithm 1 (the dof stage) first")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget={budget} is not valid; it must be a positive mean feature dimension per layer")
    bad = [n for n in layer_dof if not (math.isfinite(n) and n >= 0)]
    if bad:
        raise ValueError(f"degrees of freedom must be finite and ≥ 0, got {bad[0]}; rerun the dof stage")
    if head_dim < 1:
        raise ValueError(f"head_dim={head_dim} is not valid; it must be a positive head size")
    return policy_fn([float(n) for n in layer_dof], float(budget), int(head_dim))


def allocate_head_dims(per_head_dof: list[list[float]], budget: float, head_dim: int,
                       quantum: int = 8) -> list[list[int]]:
    """``dof_head``: per-(layer, head) dims ∝ each head's own DoF, mean over all heads ≈ C.

    Beyond the paper (which shares one dim per layer): M_lh = t⁻¹·N_lh with t⁻¹ = C / mean(N),
    rounded to a multiple of ``quantum`` (at least one quantum), so a layer's heads fall into a few
    blocks of equal dimension and the saved features are really not computed. ``head_dim`` is
    accepted for the common signature; dims are not capped.
    """
    flat = [float(n) for layer in per_head_dof for n in layer]
    if not flat:
        raise ValueError("per-head DoF is empty; run Algorithm 1 (the dof stage) first")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget={budget} is not valid; it must be a positive mean feature dimension per layer")
    bad = [n for n in flat if not (math.isfinite(n) and n >= 0)]
    if bad:
        raise ValueError(f"degrees of freedom must be finite and ≥ 0, got {bad[0]}; rerun the dof stage")
    if quantum < 1:
        raise ValueError(f"allocation.head_quantum={quantum} must be a positive number of features")
    mean = sum(flat) / len(flat)
    if mean <= 0:
        raise ValueError("every head has zero degrees of freedom; dof_head allocation is undefined")
    scale = budget / mean
    return [[max(quantum, quantum * round(scale * n / quantum)) for n in layer] for layer in per_head_dof]
