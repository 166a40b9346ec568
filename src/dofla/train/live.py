"""Live training curves: while a trainer runs, every ``log_every`` steps its latest losses, the
tokens seen, tokens/s and the time left go to a callback (the run's tracker, e.g. wandb), so a
curve can be watched instead of arriving as one table after the stage.

Losses stay on the device between log points (:meth:`Live.hold`) and reach the host together
(:meth:`Live.flush`, one synchronisation), so logging does not stall the training step.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

Log = Callable[[dict], None]


class Live:
    """Progress of one trainer: ``total`` tokens planned, ``tokens`` already done (a resumed run),
    names under ``prefix`` (``train/`` for the layerwise and end-to-end trainers)."""

    def __init__(self, on_log: Log | None, every: int, total: int, tokens: int = 0, prefix: str = "train",
                 reduce: Callable[[list[float]], list[float]] | None = None):
        self.on_log, self.every, self.total, self.prefix = on_log, max(1, int(every)), total, prefix
        self.reduce = reduce  # e.g. the mean over torchrun's ranks (then every rank must flush together)
        self.started, self.start_tokens = time.perf_counter(), tokens
        self.pending: list[tuple[dict, str, torch.Tensor]] = []

    def hold(self, entry: dict, key: str, value: torch.Tensor) -> None:
        """``entry[key]`` becomes ``float(value)`` at the next :meth:`flush` (None when not finite)."""
        self.pending.append((entry, key, value.detach()))

    def flush(self) -> None:
        """Every held value to the host at once."""
        if not self.pending:
            return
        values = torch.stack([v.to(torch.float64).reshape(()) for _, _, v in self.pending]).tolist()
        if self.reduce is not None:
            values = self.reduce(values)
        for (entry, key, _), value in zip(self.pending, values):
            entry[key] = value if math.isfinite(value) else None
        self.pending.clear()

    def due(self, step: int, last: bool = False) -> bool:
        """Whether ``step`` (counted from 1) is a log point."""
        return last or step % self.every == 0

    def rate(self, tokens: int) -> float:
        """Tokens per second since this process started the trainer."""
        seconds = time.perf_counter() - self.started
        return (tokens - self.start_tokens) / seconds if seconds > 0 else 0.0

    def log(self, step: int, tokens: int, values: dict) -> None:
        """``values`` (names without the prefix) with the step, tokens, tokens/s and ETA in minutes.

        ``<prefix>/step`` and ``<prefix>/tokens`` always come together: a tracker takes that pair as a
        live log and draws the stage's curves against its tokens (:class:`dofla.tracking.WandbTracker`)."""
        if self.on_log is None:
            return
        rate = self.rate(tokens)
        out = {f"{self.prefix}/{name}": value for name, value in values.items()}
        out.update({f"{self.prefix}/step": step, f"{self.prefix}/tokens": tokens,
                    f"{self.prefix}/tokens_per_s": rate})
        if rate > 0:
            out[f"{self.prefix}/eta_min"] = max(0, self.total - tokens) / rate / 60
        self.on_log(out)


def latest(curves: dict[int, list[dict]]) -> dict:
    """Each layer's last training loss (and held-out loss, when its last step was evaluated) and the
    mean over layers: ``layer_03/loss``, ``layer_03/heldout_loss``, ``loss_mean``."""
    values, losses = {}, []
    for i, curve in sorted(curves.items()):
        if not curve:
            continue
        last = curve[-1]
        for key in ("loss", "heldout_loss"):
            if last.get(key) is not None:
                values[f"layer_{i:02d}/{key}"] = last[key]
        if last.get("loss") is not None:
            losses.append(last["loss"])
    if losses:
        values["loss_mean"] = sum(losses) / len(losses)
    return values
