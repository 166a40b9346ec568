"""What every stage of one run shares, fixed once the teacher is loaded, and the data stage's result."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dofla.config import RunConfig
from dofla.stages.plan import TrainPlan


@dataclass(frozen=True)
class RunContext:
    """One run: its config, directory and plan, and the loaded teacher.

    ``capture`` is the teacher whose forwards produce distillation activations (a half-precision copy
    under ``train.teacher_dtype`` or ``precision=bf16``, else ``teacher``); ``train`` is how the run
    trains (:class:`~dofla.stages.plan.TrainPlan`: the mode, the source and the token ledger, built
    once at load). ``data_source`` is the data opened once before loading (prepared tokens or the
    text source, :func:`dofla.stages.sources.open_data`; None: opened where needed).
    """

    cfg: RunConfig
    out_dir: Path
    plan: tuple[str, ...]
    teacher: Any
    tokenizer: Any
    geometry: Any
    capture: Any
    train: TrainPlan
    data_source: Any = None

    @property
    def source(self) -> str:
        """Where training reads: ``cache``, ``stream`` or ``none`` (``train.source`` of the plan)."""
        return self.train.source


@dataclass(frozen=True)
class RunData:
    """The data stage's result: packed token tensors (S, L), the data's fingerprint and the key of
    the activation cache built from them (every later artifact records it)."""

    train_tokens: torch.Tensor
    heldout_tokens: torch.Tensor
    fingerprint: str
    cache_key: str


class StageTimer:
    """Wall time per stage, accumulated into ``seconds`` (and time/<stage> metrics)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
