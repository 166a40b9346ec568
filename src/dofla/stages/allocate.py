"""The allocate stage: feature dims per layer from the policy and budget -> allocation.json."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dofla.config import RunConfig
from dofla.dof import AllocationRequest, choose_dims
from dofla.dof.budget import feature_budget
from dofla.dof.oracle import measured_allocation
from dofla.feature_maps import mean_dim
from dofla.record import write_json
from dofla.stages.context import RunContext
from dofla.stages.results import Allocation, DofResult
from dofla.stages.students import layer_train_config, linear_layers


def run(ctx: RunContext, dof: DofResult | None, cache=None) -> Allocation:
    """The dims (one per layer; per head for ``dof_head``); see :func:`allocate`."""
    return allocate(ctx.cfg, dof, ctx.geometry, ctx.out_dir, cache)


def allocate(cfg: RunConfig, dof: DofResult | None, geometry, out_dir: Path, cache=None) -> Allocation:
    """Feature dims from the policy and budget -> allocation.json: one int per layer, or for
    ``dof_head`` one list of per-head ints per layer.

    Only layers that get feature maps share the budget (:func:`linear_layers`); a teacher
    sliding-window layer stays exact and gets 0. ``dof`` is None when Algorithm 1 did not run
    (``fix``); ``measured`` trains briefly at a few dims per layer (:mod:`dofla.dof.oracle`).
    """
    a, head_dim = cfg.allocation, geometry.head_dim
    budget = feature_budget(cfg, head_dim)
    layers = linear_layers(cfg, geometry)

    def pick(values: list | None) -> list | None:  # the DoF of the layers that share the budget
        return None if values is None else [values[i] for i in layers]

    def measure(budget: float, layer_dof: list[float] | None) -> dict:  # the measured policy's brief training
        train_cfg = replace(layer_train_config(cfg), softcap=geometry.softcap)
        return measured_allocation(cfg, cache, geometry, train_cfg, budget, layer_dof, layers, out_dir)

    chosen, record = choose_dims(a.policy, AllocationRequest(
        budget=budget, head_dim=head_dim, num_layers=len(layers), layer_dof=pick(dof and dof.layer_dof),
        per_head_dof=pick(dof and dof.per_head), head_quantum=a.head_quantum, head_blocks=a.head_blocks,
        measure=measure, given=pick(a.dims)))
    dims: list = [0] * geometry.num_layers
    for i, m in zip(layers, chosen):
        dims[i] = m
    record = {
        **record, "policy": a.policy, "budget": budget, "lambda": a.lam, "gram_norm": a.gram_norm, "dims": dims,
        "layer_dof": None if dof is None else dof.layer_dof, "linear_layers": layers,
        "mean_dim": mean_dim(chosen) if chosen else 0.0,
    }
    write_json(out_dir / "allocation.json", record)
    return Allocation(dims, record)
