"""The score a fine-tune trial ends with (below the trial, its store and the protocol, which all read
it), and its step, which lives in :mod:`dofla.train.continuation_step`."""
from __future__ import annotations

from dataclasses import dataclass

from dofla.train.continuation_step import (  # noqa: F401 - API: the step lives below the trainers' memory probes
    finetune_backward,
    finetune_step,
    summed_loss,
    target_tokens,
)


@dataclass
class TaskScore:
    lr: float
    epoch_accs: list[float]
    chosen_epoch: int  # 1-based
    acc: float
    steps: int = 0  # optimiser steps of the trial
    seconds: float = 0.0  # their wall time (scoring excluded; a resumed trial's parts added up)
