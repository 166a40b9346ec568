"""How torchrun's processes share a run's training (what the memory preflight plans for and the
pipeline records; :mod:`dofla.world` checks the split)."""
from __future__ import annotations

from dofla.config import RunConfig
from dofla.distributed import splits_batches
from dofla.stages.plan import DIRECT, training_mode


def train_split(cfg: RunConfig, world: int, source: str | None = None) -> str | None:
    """``data`` (each process a share of every batch: ``direct``, or a stream under
    ``train.parallel``), ``layers`` (each process its layers), or None for one process. ``source``:
    where training reads, once the run chose it (before, ``train.source``)."""
    if world <= 1:
        return None
    return "data" if training_mode(cfg) == DIRECT or splits_batches(cfg.train.parallel, source or cfg.train.source) \
        else "layers"
