"""What every stage of one run shares, fixed once the teacher is loaded, and the data stage's result."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dofla import distributed
from dofla.config import RunConfig
from dofla.measure import StepClock, peak_memory
from dofla.stages.plan import TrainPlan

logger = logging.getLogger(__name__)


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
    """Wall time per stage, accumulated into ``seconds`` (and time/<stage> metrics), and what each stage
    used beside what the preflight predicted (:meth:`metrics`, ``resources/<stage>/...``): its measured
    peak memory (:func:`dofla.measure.peak_memory` on ``device``), its step time (from the live logs
    that pass through :meth:`watch`'s tracker) and the preflight's predicted peak (``predicted``,
    filled by :func:`dofla.stages.preflight.run`)."""

    def __init__(self, device=None):
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, dict] = {}
        self.predicted: dict[str, dict] = {}
        self.device = device
        self.clock = None

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        with peak_memory(self.device) as peak:
            try:
                yield
            finally:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        self.peaks[stage] = peak
        line = self.summary(stage)
        if line is not None:
            if distributed.is_main():
                logger.info(line)

    def watch(self, tracker):
        """``tracker``, with the training steps it is told of timed."""
        self.clock = StepClock(tracker)
        return self.clock

    def metrics(self, extra_steps: dict | None = None) -> dict[str, float]:
        """``resources/<stage>/peak_bytes`` (a GPU's allocated memory) or ``peak_rss_bytes`` (the CPU
        resident set's peak: the stage's own on Linux, with ``start_rss_bytes`` the resident set it began
        with; else the process's so far), ``predicted_bytes``, ``step_s``; ``extra_steps``:
        step times measured elsewhere ({stage: seconds per step}). Only stages that trained or were predicted."""
        steps = {**(self.clock.step_seconds() if self.clock else {}), **(extra_steps or {})}
        out = {}
        for stage in sorted(set(self.predicted) | set(steps)):
            peak = self.peaks.get(stage)
            if peak:
                out[f"resources/{stage}/{'peak_bytes' if peak['kind'] == 'cuda' else 'peak_rss_bytes'}"] = peak["bytes"]
                if "start" in peak:
                    out[f"resources/{stage}/start_rss_bytes"] = peak["start"]
            for key, name in (("predicted", "predicted_bytes"), ("seconds", "predicted_s")):
                if key in self.predicted.get(stage, {}):
                    out[f"resources/{stage}/{name}"] = self.predicted[stage][key]
            if stage in steps:
                out[f"resources/{stage}/step_s"] = steps[stage]
        return out

    def summary(self, stage: str) -> str | None:
        """One line: the stage's measured peak beside its prediction (None when neither is known)."""
        peak, predicted = self.peaks.get(stage), self.predicted.get(stage, {})
        if not peak or "predicted" not in predicted:
            return None
        gib, want = peak["bytes"] / 2**30, predicted["predicted"] / 2**30
        if peak["kind"] == "rss" and "start" in peak:  # the stage's own use lies between growth and peak
            start = peak["start"] / 2**30
            return (f"dofla: the {stage} stage grew the resident set by {gib - start:.2f} GiB (from {start:.2f} to "
                    f"its peak {gib:.2f} GiB); the preflight predicted {want:.2f} GiB")
        kind = {"cuda": "allocated on the GPU"}.get(peak["kind"], "the process's peak RSS so far")
        return f"dofla: the {stage} stage peaked at {gib:.2f} GiB ({kind}); the preflight predicted {want:.2f} GiB"
