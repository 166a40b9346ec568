"""What the loop harness (:mod:`dofla.train.loop`) keeps between processes: where it checkpoints and
under which settings, the checkpoint's layout version, the random states a resume restores and host
copies of a module's state."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# bumped when the checkpoint's layout changes; a checkpoint of another layout is not resumed (the
# trainer starts over, as for other settings)
LOOP_FORMAT = 1


@dataclass
class Checkpointing:
    """Where the loop checkpoints (None: nowhere), the settings a checkpoint must have been written
    under to be resumed (``normalize`` maps both before comparing), and whether the finished state is
    kept too (a second call then returns at once)."""

    path: Path | None = None
    settings: Any = None
    normalize: Callable | None = None
    keep_final: bool = False
    legacy: Callable[[dict], dict] | None = None  # a checkpoint of the trainer's own earlier layout, to the loop's


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the module's state dict in host memory."""
    return {n: t.detach().to("cpu", copy=True) for n, t in module.state_dict().items()}


def random_states() -> dict:
    """The global random states dropout draws from (the CPU's, and every CUDA device's)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_random_states(states) -> None:
    """Back to :func:`random_states` (or a CPU state alone, as checkpoints before them kept)."""
    if isinstance(states, torch.Tensor):
        torch.set_rng_state(states)
        return
    torch.set_rng_state(states["cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def unit_record(initial: float | None = None, stopped: bool = False, best_state: dict | None = None,
                curve: list | None = None) -> dict:
    """A unit's part of the loop's state before any held-out evaluation improved on ``initial``."""
    return {"curve": list(curve or []), "initial": initial, "best": initial, "best_step": 0, "bad_evals": 0,
            "stopped": stopped, "seconds": 0.0, "best_state": best_state}


def one_unit_checkpoint(meta, key: str, module: dict, optimizer: dict, step: int, seconds: float, data, rng,
                        curve: list | None = None) -> dict:
    """A one-unit checkpoint in the loop's layout: what a trainer's legacy row builds from the checkpoint
    it wrote before it ran on the loop (:attr:`Checkpointing.legacy`)."""
    return {"format": LOOP_FORMAT, "meta": meta, "modules": {key: module}, "optimizers": {key: optimizer},
            "state": {"step": step, "seconds": seconds, "units": {key: unit_record(curve=curve)}},
            "data": data, "rng": rng}
