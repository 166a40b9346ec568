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
