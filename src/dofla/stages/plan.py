"""The stage graph: which stages a run executes, in which order, decided before any model loads.

    load ─▶ data ─▶ cache ─▶ dof ─▶ allocate ─▶ train ─▶ assemble ─▶ distill ─▶ finetune ─▶ eval ─▶ report

``load`` and ``data`` always run; the others are listed in ``cfg.stages`` (default: all but ``dof``,
which runs when the allocation policy needs it). :func:`stage_plan` closes the list over what each
listed stage needs.
"""
from __future__ import annotations

from dataclasses import replace

from dofla.config import RunConfig
from dofla.dof.allocate import reads_dof
from dofla.errors import require

STAGES = ("cache", "dof", "allocate", "train", "assemble", "distill", "finetune", "eval", "report")
PREPARATION = ("cache", "dof", "allocate")  # computed when a listed stage needs them, listed or not
TRAINING_FREE = ("sliding_window",)  # attention forms with nothing to train: no cache, dof, allocate, train


def stage_needs(cfg: RunConfig) -> dict[str, tuple[str, ...]]:
    """The stages each stage reads the artifact of, for this config (see stage_plan)."""
    if cfg.attention.name in TRAINING_FREE:  # nothing to allocate or train: assemble from the teacher
        return {"assemble": (), "distill": ("assemble",), "finetune": ("assemble",), "eval": ("assemble",), "report": ("eval",)}
    return {
        "dof": ("cache",),
        "allocate": ("dof",) if reads_dof(cfg.allocation.policy) else (),
        "train": ("cache", "allocate"),  # direct needs only the cache's key (dofla.stages.train)
        "assemble": ("allocate", "train"),
        "distill": ("assemble",),
        "finetune": ("assemble",),
        "eval": ("assemble",),
        "report": ("eval",),
    }


def stage_plan(cfg: RunConfig) -> list[str]:
    """The stages this run executes, in pipeline order.

    The listed stages run; the preparation stages (cache, dof, allocate) a listed stage needs are
    computed too (they are shared and deterministic); a later stage a listed one needs (train,
    assemble, eval) must be listed, else the run fails naming it. So ``dof`` (Algorithm 1) runs
    when the allocation policy needs it, and under ``fix`` only when listed.
    """
    unknown = [s for s in cfg.stages if s not in STAGES]
    if cfg.attention.name in TRAINING_FREE:  # its student needs no cache, DoF, allocation or training
        cfg = replace(cfg, stages=[s for s in cfg.stages if s not in (*PREPARATION, "train")])
    require(not unknown, f"stages={list(cfg.stages)} names unknown stage(s) {', '.join(map(str, unknown))}; "
             f"valid stages: {', '.join(STAGES)}")
    needs, chosen, missing = stage_needs(cfg), set(cfg.stages), []
    for stage in reversed(STAGES):  # every stage needs only earlier ones, so one backward pass closes the set
        if stage not in chosen:
            continue
        for need in needs.get(stage, ()):
            if need not in chosen and need not in PREPARATION:
                missing.append(need)
            chosen.add(need)
    order = [s for s in STAGES if s in chosen]
    require(not missing, f"stages={list(cfg.stages)} leaves out {', '.join(s for s in STAGES if s in missing)}, "
             f"which the listed stages need; use stages=[{','.join(order)}]")
    return order


