"""Allocation policies: per-layer feature dimensions under a fixed budget (mean dim = C).

Every policy is one :class:`AllocationPolicy` in ``ALLOCATION_POLICIES`` (YAML file name =
registry key): it maps an :class:`AllocationRequest` to the dims and a record for
``allocation.json``, and says whether it reads Algorithm 1's DoF (so the stage plan knows whether
the ``dof`` stage must run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dofla.registry import Registry


@dataclass(frozen=True)
class AllocationRequest:
    """What a policy may read: the budget C, the head size, and Algorithm 1's DoF of the layers
    that share the budget (None when the dof stage did not run, i.e. under a policy that reads none).

    ``measure`` is the caller's brief training run for ``measured``: ``measure(budget, layer_dof)``
    returns a record whose ``dims`` are the allocation (:func:`dofla.dof.oracle.measured_allocation`).
    """
    budget: float
    head_dim: int
    num_layers: int
    layer_dof: list[float] | None = None
    per_head_dof: list[list[float]] | None = None
    head_quantum: int = 8
    head_blocks: int = 2
    measure: Callable[[float, list[float] | None], dict] | None = None
    given: list[int] | None = None  # ``given``: the dims of the layers that share the budget, as the user set them


@dataclass(frozen=True)
class AllocationPolicy:
    """``choose(request) -> (dims, record)``: one int per layer, or one list of per-head ints per
    layer (``per_head``); ``record`` goes into allocation.json beside the dims."""
    name: str
    choose: Callable[[AllocationRequest], tuple[list, dict]]
    reads_dof: bool = True
    per_head: bool = False
    per_layer: Callable[[list[float], float, int], list[int]] | None = None  # the plain form, when it has one


ALLOCATION_POLICIES: Registry[AllocationPolicy] = Registry("allocation policy")


def register_per_layer(name: str, reads_dof: bool = True):
    """Register ``fn(layer_dof, budget, head_dim) -> dims`` (one int per layer) as a policy."""
    def decorator(fn: Callable[[list[float], float, int], list[int]]):
        def choose(request: AllocationRequest) -> tuple[list, dict]:
            layer_dof = request.layer_dof if request.layer_dof is not None else [0.0] * request.num_layers
            return allocate_dims(layer_dof, request.budget, name, request.head_dim), {}

        ALLOCATION_POLICIES.register(name)(AllocationPolicy(name, choose, reads_dof, per_layer=fn))
        return fn

    return decorator


def choose_dims(policy: str, request: AllocationRequest) -> tuple[list, dict]:
    """Dims (and a record) of ``policy`` for ``request``; no layers -> no dims."""
    chosen = ALLOCATION_POLICIES.get(policy)  # an unknown name fails first, listing the valid ones
    return chosen.choose(request) if request.num_layers else ([], {})


def reads_dof(policy: str) -> bool:
    """Whether ``policy`` needs Algorithm 1's result (an unknown name: assume it does)."""
    return ALLOCATION_POLICIES.get(policy).reads_dof if policy in ALLOCATION_POLICIES else True


def choose_given(request: AllocationRequest) -> tuple[list, dict]:
    """``given``: the user's dims (``allocation.dims``), as they are; the budget does not enter."""
    if request.given is None or len(request.given) != request.num_layers:
        raise ValueError(f"allocation.policy=given needs one dim per layer that gets features ({request.num_layers}); "
                         f"allocation.dims gives {0 if request.given is None else len(request.given)}")
    return [int(m) for m in request.given], {}


ALLOCATION_POLICIES.register("given")(AllocationPolicy("given", choose_given, reads_dof=False))


@register_per_layer("fix", reads_dof=False)
def allocate_fix(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """The budget in every layer (the paper's baseline: C = head size)."""
    return [max(1, round(budget))] * len(layer_dof)


@register_per_layer("dof")
def allocate_dof(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """Algorithm 1: M_s = round(t⁻¹·N_s) with t⁻¹ = C / mean(N) (plain rounding, mean ≈ C)."""
    mean = sum(layer_dof) / len(layer_dof)
    if mean <= 0:
        raise ValueError("every layer has zero degrees of freedom; dof allocation is undefined")
    scale = budget / mean
    return [max(1, round(scale * n)) for n in layer_dof]


@register_per_layer("dof_clip")
def allocate_dof_clip(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """Algorithm 1, then each layer capped at the head size (cheaper than dof)."""
    return [min(m, head_dim) for m in allocate_dof(layer_dof, budget, head_dim)]


@register_per_layer("fix_max")
def allocate_fix_max(layer_dof: list[float], budget: float, head_dim: int) -> list[int]:
    """Every layer at the largest dim ``dof`` gives at this budget: an upper reference that costs
    more than the budget (mean dim = max of the dof dims)."""
    return [max(allocate_dof(layer_dof, budget, head_dim))] * len(layer_dof)


def allocate_dims(layer_dof: list[float], budget: int | float, policy: str, head_dim: int) -> list[int]:
    """Per-layer feature dims (one int per layer) for ``policy`` (fix | dof | dof_clip | fix_max).

    ``budget`` is C, the mean feature dimension per layer (``fix_max`` exceeds it on purpose);
    ``head_dim`` caps ``dof_clip``.
    """
    policy_fn = ALLOCATION_POLICIES.get(policy).per_layer  # unknown names fail first, listing the valid ones
    if policy_fn is None:
        raise ValueError(f"allocation policy {policy!r} has no per-layer form; use choose_dims")
    _check_inputs(layer_dof, budget, "layer_dof")
    if head_dim < 1:
        raise ValueError(f"head_dim={head_dim} is not valid; it must be a positive head size")
    return policy_fn([float(n) for n in layer_dof], float(budget), int(head_dim))


def allocate_head_dims(per_head_dof: list[list[float]], budget: float, head_dim: int,
                       quantum: int = 8, max_blocks: int = 0) -> list[list[int]]:
    """``dof_head``: per-(layer, head) dims ∝ each head's own DoF, mean over all heads ≈ C.

    Beyond the paper (which shares one dim per layer): M_lh = t⁻¹·N_lh with t⁻¹ = C / mean(N).
    With ``max_blocks`` B > 0, each layer's heads are split (sorted by M) into at most B groups of
    least within-group squared deviation and each group gets its mean M, so the layer runs at most B
    feature maps (the per-block overhead is what costs on a CPU) and the total is unchanged. Dims
    are rounded to a multiple of ``quantum`` (at least one quantum). ``head_dim`` is accepted for
    the common signature; dims are not capped.
    """
    flat = [float(n) for layer in per_head_dof for n in layer]
    _check_inputs(flat, budget, "per-head DoF")
    if quantum < 1:
        raise ValueError(f"allocation.head_quantum={quantum} must be a positive number of features")
    if max_blocks < 0:
        raise ValueError(f"allocation.head_blocks={max_blocks} must be ≥ 0 (0: no limit)")
    mean = sum(flat) / len(flat)
    if mean <= 0:
        raise ValueError("every head has zero degrees of freedom; dof_head allocation is undefined")
    scale = budget / mean
    out = []
    for layer in per_head_dof:
        ideal = [scale * n for n in layer]
        dims = [0] * len(ideal)
        for group in _head_groups(ideal, max_blocks or len(ideal)):
            m = sum(ideal[h] for h in group) / len(group)
            for h in group:
                dims[h] = max(quantum, quantum * round(m / quantum))
        out.append(dims)
    return out


def _choose_head_dims(request: AllocationRequest) -> tuple[list, dict]:
    if request.per_head_dof is None:
        raise ValueError("dof_head needs Algorithm 1's per-head DoF; run the dof stage first")
    return allocate_head_dims(request.per_head_dof, request.budget, request.head_dim, request.head_quantum,
                              request.head_blocks), {}


def _choose_measured(request: AllocationRequest) -> tuple[list, dict]:
    if request.measure is None:
        raise ValueError("the measured policy trains each layer briefly at a few dims; it needs the allocate "
                         "stage's measure step (dofla.dof.oracle.measured_allocation)")
    record = request.measure(request.budget, request.layer_dof)
    return record["dims"], record


ALLOCATION_POLICIES.register("dof_head")(AllocationPolicy("dof_head", _choose_head_dims, per_head=True))
# reads the DoF only to report its rank correlation with the measured sensitivity
ALLOCATION_POLICIES.register("measured")(AllocationPolicy("measured", _choose_measured))


def _check_inputs(dof: list[float], budget: float, what: str) -> None:
    """One sentence for an empty DoF list, a bad budget or a negative / non-finite DoF."""
    if not dof:
        raise ValueError(f"{what} is empty; run Algorithm 1 (the dof stage) first")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget={budget} is not valid; it must be a positive mean feature dimension per layer")
    bad = [n for n in dof if not (math.isfinite(n) and n >= 0)]
    if bad:
        raise ValueError(f"degrees of freedom must be finite and ≥ 0, got {bad[0]}; rerun the dof stage")


def _head_groups(values: list[float], blocks: int) -> list[list[int]]:
    """Indices split, in sorted order of ``values``, into ≤ ``blocks`` contiguous groups with the
    least total within-group squared deviation (exact dynamic programme; a layer has few heads)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    xs = [values[i] for i in order]
    n, blocks = len(xs), min(blocks, len(xs))

    def cost(a: int, b: int) -> float:  # squared deviation of xs[a:b] from its mean
        part = xs[a:b]
        mu = sum(part) / len(part)
        return sum((x - mu) ** 2 for x in part)

    best = {(0, 0): (0.0, [])}  # (groups used, items covered) -> (cost, cut points)
    for g in range(1, blocks + 1):
        for end in range(g, n + 1):
            options = [(best[(g - 1, start)][0] + cost(start, end), best[(g - 1, start)][1] + [end])
                       for start in range(g - 1, end) if (g - 1, start) in best]
            best[(g, end)] = min(options)
    _, cuts = min(best[(g, n)] for g in range(1, blocks + 1))
    starts = [0] + cuts[:-1]
    return [order[a:b] for a, b in zip(starts, cuts)]
