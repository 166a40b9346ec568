"""One optimiser step, shared by every trainer (:func:`optimiser_step`, the loop harness's): the learning
rate schedule, micro-batches and the accumulation of their gradients into one step."""
from __future__ import annotations

import contextlib
import math
import time

import torch

from dofla import distributed
from dofla.errors import DoflaError
from dofla.precision import autocast


class NonFiniteLossError(DoflaError, FloatingPointError):
    """A training step produced NaN/inf; the message names the layer and the step."""


def lr_factor(step: int, cfg, floor: float = 0.0) -> float:
    """The learning-rate multiplier at ``step`` for a config with ``warmup_steps``, ``schedule`` and
    ``steps``: linear warm-up, then constant or cosine down to ``floor`` of the peak."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def micro_batches(batch: torch.Tensor, cfg) -> list[tuple[torch.Tensor, float]]:
    """``batch`` (rows first) cut into ``cfg.micro_batch_size`` rows, each with its share of the batch."""
    size = cfg.micro_batch_size or len(batch)
    return [(part, len(part) / len(batch)) for part in batch.split(size)]


class Accumulator:
    """One optimiser step of a batch given in micro-batches: :meth:`add` each micro-batch's loss with
    its weight (its share of the batch: the batch's loss is Σ weight · loss), then :meth:`step`.

    A non-finite loss fails (or skips) the step as a whole. Nothing here waits for the device until
    :meth:`step`, which makes one host synchronisation for every finiteness check together.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        optimizer.zero_grad(set_to_none=True)
        self.total: torch.Tensor | float = 0.0

    def add(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        (loss * weight).backward()  # a non-finite loss poisons the gradients; step() then skips them
        self.add_backward_done(loss.detach(), weight)

    def add_backward_done(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """A micro-batch whose ``weight`` × backward already ran (e.g. in chunks): its loss, detached."""
        self.total = self.total + loss * weight

    def finite(self) -> bool:
        """The batch's loss and every gradient are finite (one synchronisation)."""
        checks = [torch.isfinite(p.grad).all() for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
        if isinstance(self.total, torch.Tensor):  # on the parameters' device, like the gradients
            checks.append(torch.isfinite(self.total))
        return bool(torch.stack(checks).all()) if checks else True

    def step(self, message: str, skip_nonfinite: bool, data_parallel: bool = False,
             grad_clip: float = 0.0) -> torch.Tensor | None:
        """The Adam step; returns the batch's loss (on the device), or None when skipped
        (NonFiniteLossError unless ``skip_nonfinite``). Gradients are checked too: the fp64 ``l2`` loss
        with ``scale=none`` can be finite while its gradient overflows the fp32 features, and one inf
        gradient would turn every parameter NaN. ``data_parallel``: under torchrun, gradients are
        averaged across the ranks before the step and all ranks agree on skipping (every rank must
        call it). ``grad_clip`` > 0: the gradients' total norm is clipped to it before the step."""
        optimizer = self.optimizer
        if data_parallel:
            distributed.average_gradients([p for g in optimizer.param_groups for p in g["params"]])
        finite = self.finite()
        if data_parallel:
            finite = distributed.all_true(finite)
        if finite:
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], grad_clip)
            optimizer.step()
            return self.total if isinstance(self.total, torch.Tensor) else torch.tensor(self.total)
        optimizer.zero_grad(set_to_none=True)
        if not skip_nonfinite:
            raise NonFiniteLossError(f"{message}; lower the learning rates, check the activations, "
                                     "or set train.skip_nonfinite=true")
        return None


def optimiser_step(trainer, batch: torch.Tensor, keys: list, cfg, step: int, live,
                   data_parallel: bool = False) -> None:
    """Step ``step`` of the units ``keys`` on ``batch``: per micro-batch the trainer's forward and each
    unit's loss and backward (accumulated), then per unit the scheduled learning rate and one optimiser
    step, its loss held for the next log (what the loop runs every step; the memory preflight traces
    it alone; ``cfg`` may be any trainer config with the loop's fields, ``grad_clip`` and ``lr_floor``
    defaulting to off)."""
    units = trainer.units
    accumulated = {key: Accumulator(units[key].optimizer) for key in keys}
    precision = autocast(cfg.precision, trainer.device) if trainer.autocast else contextlib.nullcontext()
    with trainer.step_context(step):
        for part, share in micro_batches(batch, cfg):
            trainer.forward(part, keys)
            for key in keys:
                started = time.perf_counter()
                if trainer.own_backward:
                    accumulated[key].add_backward_done(trainer.backward(key, part, share), share)
                else:
                    with precision:
                        loss = trainer.loss(key, part)
                    accumulated[key].add(loss, share)
                units[key].record["seconds"] += time.perf_counter() - started
    for key in keys:
        unit, started = units[key], time.perf_counter()
        for group, lr in zip(unit.optimizer.param_groups, unit.base_lrs):
            group["lr"] = lr * lr_factor(step, cfg, floor=getattr(cfg, "lr_floor", 0.0))
        loss = accumulated[key].step(trainer.message(key, step), cfg.skip_nonfinite, data_parallel,
                                     getattr(cfg, "grad_clip", 0.0))
        curve = unit.record["curve"]
        curve.append({"step": step, "loss": None, **({} if loss is not None else {"skipped": True})})
        if loss is not None:
            live.hold(curve[-1], "loss", loss)
        unit.record["seconds"] += time.perf_counter() - started
    trainer.after_step()
