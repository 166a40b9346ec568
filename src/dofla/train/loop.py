"""One training loop under every trainer; a trainer (:class:`Trainer`) gives only what differs: its
units, its batches, the loss of a micro-batch, the held-out value and its data position.

    for each step:   kill point ─▶ batch ─▶ per micro-batch every active unit's loss and backward
                     ─▶ per unit the scheduled learning rate and one optimiser step (refused, or
                     skipped, when a loss or gradient is not finite) ─▶ every eval_every steps the
                     held-out values (best state, patience) ─▶ every checkpoint_every steps a
                     checkpoint keyed by the settings (a killed run resumes to the same bits)
                     ─▶ every log_every steps the live curves

until ``steps``, until every unit has stopped (patience), or until the trainer's data runs out. A
unit (:class:`Unit`) is what one optimiser trains: a layer's feature map (one per layer for the
layerwise trainers), or every trained parameter of a student (direct, KL, LoRA, a fine-tune trial). Losses stay on the device between log points
(:class:`~dofla.train.live.Live`): a step waits for the device once, in its finiteness check.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Hashable

import torch
from tqdm.auto import tqdm

from dofla import distributed
from dofla.artifacts import load_checkpoint, torch_save_atomic
from dofla.faults import kill_point
from dofla.train.checkpoints import (  # noqa: F401 - API: the trainers import these from here
    LOOP_FORMAT, Checkpointing, cpu_state, random_states, restore_random_states, unit_record,
)
from dofla.train.live import Live, Log, latest
from dofla.train.step import optimiser_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """What the loop reads of a trainer's config (:class:`dofla.train.config.StepConfig` has every field):
    ``eval_every`` 0 never evaluates (no best state: the final one is kept); ``patience`` counts
    evaluations without improvement before a unit stops (0: never)."""

    steps: int
    warmup_steps: int = 0
    schedule: str = "constant"
    eval_every: int = 0
    patience: int = 0
    checkpoint_every: int = 50  # 0: only where the trainer asks (Trainer.wants_checkpoint)
    log_every: int = 10
    skip_nonfinite: bool = False
    micro_batch_size: Any = None
    precision: str = "fp32"
    grad_clip: float = 0.0  # the gradients' norm is clipped to this before the step (0: never)
    lr_floor: float = 0.0  # the cosine schedule ends at this fraction of the peak rate

    @classmethod
    def of(cls, cfg, **changes) -> "LoopConfig":
        """The loop's fields of ``cfg`` (any config with these names), with ``changes``."""
        return cls(**{**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}, **changes})


@dataclass
class Unit:
    """What one optimiser trains: ``module``'s parameters in ``optimizer`` (None: nothing to train, the
    unit is stopped from the start). ``keep`` picks the entries of its state dict a checkpoint holds
    (default all; a student checkpoints only what trains). ``record`` is its part of the loop's state:
    its curve, held-out values, best state and time."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    keep: Callable[[str], bool] = lambda name: True
    base_lrs: list[float] = field(default_factory=list)
    record: dict = field(default_factory=dict)

    def __post_init__(self):
        # the configured rates, before a checkpoint's scheduled ones replace the optimiser's groups
        if not self.base_lrs and self.optimizer is not None:
            self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]

    def trained_state(self) -> dict:
        return {n: t for n, t in self.module.state_dict().items() if self.keep(n)}


class Trainer:
    """What a trainer gives the loop. ``units``: its units by key (a layer index, or a name);
    ``batch_tokens``: tokens per step (for the live rate and the bar); ``kill``: the kill point's
    prefix (``f"{kill}{step}"``, :mod:`dofla.faults`); ``autocast``: whether the loop runs
    :meth:`losses` under the precision's autocast (the layer losses autocast themselves)."""

    units: dict[Hashable, Unit]
    batch_tokens: int
    kill: str = "train:step"
    autocast: bool = False
    device: torch.device = torch.device("cpu")
    log_prefix: str = "train"  # the live log's names: ``{log_prefix}/loss``, ...
    bar_unit: str = "tok"  # what ``batch_tokens`` counts, for the progress bar
    own_backward: bool = False  # :meth:`backward` instead of :meth:`loss` (e.g. a KL backward in chunks)

    def next_batch(self, step: int) -> torch.Tensor | None:
        """This step's batch, rows first (under data parallelism: this process's rows); None when the
        data has run out (the loop ends there, the steps run so far its result)."""
        raise NotImplementedError

    def step_context(self, step: int):
        """A context the step's forwards and backwards run in (e.g. a hybrid's windows dropped)."""
        return contextlib.nullcontext()

    def after_step(self) -> None:
        """After the step's optimiser steps (e.g. parameters projected back onto their constraints)."""

    def wants_checkpoint(self, step: int) -> bool:
        """A checkpoint after ``step`` steps besides every ``checkpoint_every`` (e.g. at an epoch's end)."""
        return False

    def forward(self, rows: torch.Tensor, keys: list) -> None:
        """Prepare the micro-batch ``rows`` for the losses of the units ``keys`` (e.g. one teacher forward
        for every layer); then :meth:`loss` is asked once per unit, in order."""

    def loss(self, key: Hashable, rows: torch.Tensor) -> torch.Tensor:
        """Unit ``key``'s loss on the micro-batch ``rows`` (the loop runs its backward before asking for
        the next unit's, so a unit's activations can be freed first)."""
        raise NotImplementedError

    def backward(self, key: Hashable, rows: torch.Tensor, weight: float) -> torch.Tensor:
        """With ``own_backward``: unit ``key``'s loss on ``rows``, ``weight`` × its backward run here;
        returns the loss, detached."""
        raise NotImplementedError

    def heldout(self, key: Hashable) -> float | None:
        """Unit ``key``'s held-out value (lower is better); None: this trainer does not evaluate."""
        return None

    def data_state(self):
        """The data position a checkpoint keeps (None: nothing to keep)."""
        return None

    def restore_data(self, state) -> None:
        """Back to a checkpoint's data position."""

    def log_values(self, curves: dict[Hashable, list[dict]]) -> dict:
        """What a live log shows, from the units' curves: each layer's latest losses and their mean."""
        return latest(curves)

    def message(self, key: Hashable, step: int) -> str:
        """The first half of the sentence a non-finite step fails with."""
        return f"{key}: non-finite training loss at step {step}"


@dataclass
class LoopResult:
    """Where the loop stopped: ``step`` (steps run, resumed ones included), ``tokens`` seen, the wall
    ``seconds`` (resumed parts included) and each unit's record (its curve, ``initial``, ``best``,
    ``best_step``, ``seconds``; every unit ends holding its best state)."""

    step: int
    tokens: int
    seconds: float
    records: dict[Hashable, dict]


def run_loop(trainer: Trainer, cfg: LoopConfig, checkpoint: Checkpointing = Checkpointing(),
             on_log: Log | None = None, data_parallel: bool = False, desc: str = "train",
             progress: bool = True) -> LoopResult:
    """Train ``trainer``'s units for ``cfg.steps`` steps (or until every unit stops), resuming from
    ``checkpoint`` when it holds this run's settings. ``data_parallel``: under torchrun every rank
    calls this with its rows of each batch; gradients are averaged, rank 0's held-out values decide
    and rank 0 writes the checkpoint."""
    loop = _Loop(trainer, cfg, checkpoint, on_log, data_parallel and distributed.world() > 1)
    if not any(u.optimizer is not None for u in trainer.units.values()) or cfg.steps == 0:
        loop.start(resume=False)
        return loop.finish()
    loop.start(resume=True)
    bar = tqdm(total=cfg.steps * trainer.batch_tokens, initial=loop.step * trainer.batch_tokens, desc=desc,
               unit=trainer.bar_unit, unit_scale=True, leave=False, disable=not progress or not distributed.is_main())
    while loop.step < cfg.steps and loop.active() and not loop.exhausted:
        if loop.train_step():
            bar.update(trainer.batch_tokens)
    bar.close()
    if checkpoint.keep_final:
        loop.save()
    return loop.finish()


class _Loop:
    """The loop's state and its parts (see :func:`run_loop`)."""

    def __init__(self, trainer: Trainer, cfg: LoopConfig, checkpoint: Checkpointing, on_log, data_parallel: bool):
        self.trainer, self.cfg, self.checkpoint, self.dp = trainer, cfg, checkpoint, data_parallel
        self.units, self.step, self.seconds = trainer.units, 0, 0.0
        self.on_log, self.exhausted = on_log, False

    def start(self, resume: bool) -> None:
        """Resume from the checkpoint, or take every unit's initial held-out value."""
        saved = self._load() if resume else None
        if saved is not None:
            for key, unit in self.units.items():
                unit.module.load_state_dict(saved["modules"][key], strict=False)
                if unit.optimizer is not None:
                    unit.optimizer.load_state_dict(saved["optimizers"][key])
                unit.record = saved["state"]["units"][key]
            restore_random_states(saved["rng"])
            self.trainer.restore_data(saved["data"])
            self.step, self.seconds = saved["state"]["step"], saved["state"]["seconds"]
        else:
            for key, unit in self.units.items():
                initial = self._agreed(self.trainer.heldout(key)) if self.cfg.eval_every else None
                unit.record = unit_record(initial, unit.optimizer is None,
                                          None if initial is None else cpu_state(unit.module))
        tokens = self.step * self.trainer.batch_tokens
        self.live = Live(self.on_log, self.cfg.log_every, self.cfg.steps * self.trainer.batch_tokens, tokens,
                         prefix=self.trainer.log_prefix, reduce=distributed.mean_across if self.dp else None)
        self.started = time.perf_counter() - self.seconds

    def active(self) -> list:
        return [key for key, unit in self.units.items() if not unit.record["stopped"]]

    def train_step(self) -> bool:
        """One step; False (and ``exhausted``) when the trainer's data has run out."""
        cfg, trainer = self.cfg, self.trainer
        kill_point(f"{trainer.kill}{self.step}")
        batch = trainer.next_batch(self.step)
        if batch is None:
            self.exhausted = True
            return False
        optimiser_step(trainer, batch, self.active(), cfg, self.step, self.live, self.dp)
        self.step += 1
        if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
            self._evaluate()
        self.seconds = time.perf_counter() - self.started
        if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or trainer.wants_checkpoint(self.step):
            self.save()
        if self.live.due(self.step, last=self.step == cfg.steps):
            self.live.flush()
            if self.on_log is not None:
                curves = {key: unit.record["curve"] for key, unit in self.units.items()}
                self.live.log(self.step, self.step * trainer.batch_tokens, trainer.log_values(curves))
        return True

    def _evaluate(self) -> None:
        """Every active unit's held-out value: the best state kept, patience counted."""
        self.live.flush()
        for key in self.active():
            unit, record = self.units[key], self.units[key].record
            value = self._agreed(self.trainer.heldout(key))
            record["curve"][-1]["heldout_loss"] = value
            if value < record["best"]:
                record.update(best=value, best_step=self.step, bad_evals=0, best_state=cpu_state(unit.module))
            else:
                record["bad_evals"] += 1
                record["stopped"] = self.cfg.patience > 0 and record["bad_evals"] >= self.cfg.patience

    def save(self) -> None:
        """A checkpoint of everything a resume needs (rank 0 writes it)."""
        if self.checkpoint.path is None:
            return
        self.live.flush()
        if self.dp and not distributed.is_main():
            return
        torch_save_atomic({
            "format": LOOP_FORMAT, "meta": self.checkpoint.settings,
            "modules": {key: unit.trained_state() for key, unit in self.units.items()},
            "optimizers": {key: unit.optimizer.state_dict() for key, unit in self.units.items()
                           if unit.optimizer is not None},
            "state": {"step": self.step, "seconds": self.seconds,
                      "units": {key: unit.record for key, unit in self.units.items()}},
            "data": self.trainer.data_state(), "rng": random_states()}, self.checkpoint.path)

    def finish(self) -> LoopResult:
        """Every unit to its best state (when evaluated); the loop's result."""
        self.live.flush()
        for unit in self.units.values():
            if unit.record.get("best_state") is not None:
                unit.module.load_state_dict(unit.record["best_state"], strict=False)
        return LoopResult(self.step, self.step * self.trainer.batch_tokens, self.seconds,
                          {key: unit.record for key, unit in self.units.items()})

    def _load(self) -> dict | None:
        saved = load_checkpoint(self.checkpoint.path, self.checkpoint.settings, self.checkpoint.normalize)
        if saved is not None and "format" not in saved and self.checkpoint.legacy is not None:
            saved = self.checkpoint.legacy(saved)
        if saved is not None and saved.get("format") != LOOP_FORMAT:
            logger.warning(f"dofla: checkpoint {self.checkpoint.path} was written by an older dofla; starting over")
            return None
        return saved

    def _agreed(self, value):
        return distributed.broadcast(value) if self.dp else value
