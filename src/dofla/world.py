"""The checks of how torchrun's processes share a run's training (one process: no split, nothing to
check); the split itself is :func:`dofla.stages.parallel.train_split`."""
from __future__ import annotations

from dofla.config import RunConfig
from dofla.errors import require
from dofla.stages.parallel import train_split
from dofla.stages.plan import DIRECT, stage_plan, training_mode


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
