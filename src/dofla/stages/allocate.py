"""The allocate stage: feature dims per layer from the policy and budget -> allocation.json; or, for
``allocation=budget``, every KV head's plan under a memory budget (:func:`run_budget`)."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

from dofla.config import RunConfig
from dofla.dof import AllocationRequest, aggregate_heads, choose_dims
from dofla.dof.allocator import allocate as allocate_budget, menu_signals
from dofla.dof.menu import default_menu, option_bytes
from dofla.dof.menu_cache import earlier_menu, menu_file
from dofla.dof.budget import MemoryBudgetConfig, feature_budget, memory_budget
from dofla.dof.knapsack import MIB
from dofla.dof.softmax_layers import passkey_prompts
from dofla.dof.oracle import measured_allocation
from dofla.feature_maps import mean_dim
from dofla.models.plan import StudentPlan
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext
from dofla.stages.results import Allocation, DofResult
from dofla.stages.keys import teacher_settings
from dofla.stages.sources import cache_root
from dofla.stages.students import allocated_plan_path, layer_train_config, linear_layers

logger = logging.getLogger(__name__)
# added to budget.seed for the allocator's passkey prompts: keys and depths of their own, apart from the
# softmax-layer ranking's and the eval's
PROMPT_SALT = 7_919


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


def run_budget(ctx: RunContext, train_tokens, dof: DofResult | None = None) -> tuple[StudentPlan, dict]:
    """``allocation=budget``: the plan that spends ``budget=memory`` best, measured on the first
    ``budget.calibration_seqs`` sequences of the run's training tokens ``train_tokens`` (S, L) (never the
    held-out text) and ``budget.prompts`` passkey prompts -> ``allocation.json`` (the allocator's record, its
    settings, the plan) and the plan file the later stages read (:func:`allocated_plan_path`).

    Keyed on the teacher, the memory budget, the menu's prices (each option's bytes at the budget's context, as
    the code counts them: a change in what a form holds solves again) and the calibration text (its settings):
    reused from the run's
    ``allocation.json`` or, for another run of the same settings, from ``allocations/`` beside the activation
    caches (the returned record then says ``reused``). The measured menu is kept apart, keyed on the same
    settings less the budget's size and weights (``SOLVE_ONLY``) and the repair rounds: another budget solves
    on it and measures its chosen plan alone (the record's ``menu_measurement`` says where it came from).
    ``dof``: the dof stage's estimate, which ``budget.state_sizing=dof`` sizes the linear states by
    (:func:`unit_dof`; then in the settings)."""
    cfg, b = ctx.cfg, ctx.cfg.budget
    memory = memory_budget(cfg)
    units = unit_dof(dof, ctx.geometry.num_kv_heads, memory.granularity, cfg.allocation.head_aggregate) \
        if memory.state_sizing == "dof" and dof is not None else None
    calibration = train_tokens[:b.calibration_seqs]
    prompts = passkey_prompts(ctx.tokenizer, b.prompt_length, b.prompts, seed=b.seed + PROMPT_SALT)
    # reuse_prefix changes how the menu is measured, not what (the two paths agree exactly): out of the key
    budget = {k: v for k, v in asdict(memory).items() if k != "reuse_prefix" and not  # added later, at default:
              (k in ("granularity", "solver", "estimator", "copy_weight", "state_sizing")
               and v == getattr(MemoryBudgetConfig, k))}
    settings = {"teacher": teacher_settings(cfg), "budget": budget, "repair_rounds": b.repair_rounds,
                "calibration": _digest([calibration] + [t for pair in prompts for t in pair]),
                "prices": [option_bytes(o, ctx.geometry, memory.context, memory.kv_bytes) for o in default_menu(memory)]}
    if units is not None:
        settings["dof"] = units
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    own, shared = ctx.out_dir / "allocation.json", cache_root(cfg) / "allocations" / f"budget-{digest}.json"
    found = next(((path, record) for path in (own, shared) if (record := read_json(path)) is not None
                  and record.get("settings") == settings), None)
    if found is not None:
        record = found[1]
        logger.info(f"dofla: allocation=budget: reused {found[0]} (measured in {record['cost']['seconds']:.1f} s)")
    else:
        menu_path, menu_key = menu_file(cache_root(cfg), settings)
        kept = read_json(menu_path)
        kept = kept if kept is not None and kept.get("settings") == menu_key and memory.solver == "milp" else None
        measures = kept is None and memory.solver == "milp" and memory.estimator == "measured"
        earlier = earlier_menu(cache_root(cfg), menu_key) if measures else None
        _, record = allocate_budget(ctx.teacher, memory, calibration, prompts, repair_rounds=b.repair_rounds,
                                    measured=kept and kept["measured"], unit_dof=units, known=earlier)
        measurement = {"file": menu_path.name, "reused": kept is not None,
                       "seconds": kept["seconds"] if kept else record["cost"]["seconds"]}
        if earlier and record["cost"]["reused"]:  # the menu's seconds: this measurement's and the earlier one's
            measurement["extends"] = {k: earlier[k] for k in ("file", "shared", "seconds")}
            measurement["seconds"] += earlier["seconds"]
        record = {**record, "settings": settings, "menu_measurement": measurement,
                  "calibration": {"sequences": int(calibration.shape[0]), "seq_len": int(calibration.shape[1]),
                                  "prompts": len(prompts), "prompt_length": b.prompt_length}}
        if kept is None and (measured := menu_signals(record)) is not None:
            write_json(menu_path, {"settings": menu_key, "measured": measured, "seconds": measurement["seconds"]})
        write_json(shared, record)
        cost = record["cost"]
        how = (f"solved on the menu measured before ({menu_path.name}, {kept['seconds']:.1f} s then) and measured "
               f"the chosen plan" if kept else f"predicted the menu to first order ({cost['students']} students "
               f"built, the chosen plan measured)" if memory.estimator == "first_order"
               else f"measured {cost['students']} students" + (
                   f", {cost['reused']} options' signals taken from the menu measured before ({earlier['file']}: "
                   f"{', '.join(earlier['shared'])})" if cost.get("reused") else ""))
        logger.info(f"dofla: allocation=budget: {how} in {cost['seconds']:.1f} s ({cost['fit_seconds']:.1f} s "
                    f"fitting); plan {record['plan_bytes'] / MIB:.3f} MiB of a {record['budget']['mib']:.3f} MiB "
                    f"budget at {memory.context} tokens")
    write_json(own, record)
    plan = StudentPlan.from_list(record["plan"])
    write_json(allocated_plan_path(ctx.out_dir), plan.to_list())
    return plan, {**record, "reused": found is not None}


def unit_dof(dof: DofResult, kv_heads: int, granularity: str, aggregate: str) -> list[float]:
    """Each allocation unit's degrees of freedom from the dof stage's per-query-head values: a KV head's
    is its query heads' (``aggregate``: the allocation's ``head_aggregate``), a layer's its heads'."""
    units = []
    for layer in dof.per_head:
        if layer is None:
            raise ValueError("state_sizing=dof needs every layer's DoF, and the dof stage left a layer out; "
                             "allocate over a teacher whose every layer attends globally")
        group = len(layer) // kv_heads
        parts = [layer] if granularity == "layer" else [layer[j * group:(j + 1) * group] for j in range(kv_heads)]
        units += [aggregate_heads(part, aggregate) for part in parts]
    return units


def _digest(tensors: list) -> str:
    """A hash of token tensors' shapes and values."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(json.dumps(list(t.shape)).encode())
        h.update(t.detach().cpu().long().numpy().tobytes())
    return "sha256:" + h.hexdigest()
