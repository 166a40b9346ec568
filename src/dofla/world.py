"""How torchrun's processes share a run's training, and the checks of that split (one process: no
split, nothing to check)."""
from __future__ import annotations

from dofla.config import RunConfig
from dofla.distributed import splits_batches
from dofla.errors import require
from dofla.stages.plan import DIRECT, stage_plan, training_mode


def train_split(cfg: RunConfig, world: int, source: str | None = None) -> str | None:
    """``data`` (each process a share of every batch: ``direct``, or a stream under
    ``train.parallel``), ``layers`` (each process its layers), or None for one process. ``source``:
    where training reads, once the run chose it (before, ``train.source``)."""
    if world <= 1:
        return None
    return "data" if training_mode(cfg) == DIRECT or splits_batches(cfg.train.parallel, source or cfg.train.source) \
        else "layers"


def validate_world(cfg: RunConfig, world: int, source: str | None = None) -> None:
    """Checks for a data-parallel run under torchrun with ``world`` processes; ``source`` as for
    :func:`train_split`."""
    if world <= 1:
        return
    if "distill" in stage_plan(cfg):
        require(cfg.distill.batch_size % world == 0,
                f"distill.batch_size={cfg.distill.batch_size} cannot be split evenly over {world} torchrun processes; "
                f"use a multiple of {world}")
    if "train" not in cfg.stages:
        return
    if training_mode(cfg) == DIRECT:
        require(cfg.train.direct_batch_size % world == 0,
                 f"train.direct_batch_size={cfg.train.direct_batch_size} cannot be split evenly over {world} "
                 f"torchrun processes; use a multiple of {world}")
    elif train_split(cfg, world, source) == "data":
        require(source != "cache", "train.parallel=data splits a stream's batches, but this run reads the activation "
                "cache (train.source=auto chose it); set train.source=stream, or train.parallel=layers (or auto)")
        require(cfg.train.batch_size % world == 0,
                f"train.batch_size={cfg.train.batch_size} cannot be split evenly over {world} torchrun processes "
                f"(train.parallel={cfg.train.parallel} splits every streamed batch); use a multiple of {world}, "
                "or train.parallel=layers")
