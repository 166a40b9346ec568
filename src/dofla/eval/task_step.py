"""One step of the fine-tune protocol, and the score a trial ends with (below the trial, its store and
the protocol, which all read them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dofla.eval.task_data import pad_batch
from dofla.precision import autocast


@dataclass
class TaskScore:
    lr: float
    epoch_accs: list[float]
    chosen_epoch: int  # 1-based
    acc: float
    steps: int = 0  # optimiser steps of the trial
    seconds: float = 0.0  # their wall time (scoring excluded; a resumed trial's parts added up)



def target_tokens(labels: torch.Tensor) -> int:
    """Tokens whose next-token loss counts in a (B, T) label tensor (the first position predicts nothing)."""
    return int((labels[:, 1:] != -100).sum())


def summed_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, precision: str) -> torch.Tensor:
    """Σ over the target tokens of the next-token cross-entropy; the forward under ``precision``'s
    autocast, the loss in fp32 whatever dtype the logits come in."""
    with autocast(precision, input_ids.device):
        logits = model(input_ids=input_ids, use_cache=False).logits
    vocab, dtype = logits.shape[-1], torch.promote_types(logits.dtype, torch.float32)
    return torch.nn.functional.cross_entropy(logits[:, :-1].to(dtype).reshape(-1, vocab), labels[:, 1:].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def finetune_backward(model, rows: list, max_length: int, micro_batch: int | None, precision: str = "fp32",
                      weight: float = 1.0) -> torch.Tensor:
    """``weight`` × the gradient of the mean next-token loss over every target token of ``rows``
    ((context, continuation) id pairs), formed ``micro_batch`` rows at a time (None: all at once), each
    part padded to its own widest row: the parts' summed losses over the whole batch's target count give
    exactly the whole batch's gradient. Returns the batch's loss, on the device (no host wait)."""
    device = next(model.parameters()).device
    size = micro_batch or len(rows)
    parts = [pad_batch(rows[i : i + size], max_length) for i in range(0, len(rows), size)]
    count = max(1, sum(target_tokens(labels) for _, labels in parts))  # CPU tensors: no device wait
    total = 0.0
    for input_ids, labels in parts:
        loss = summed_loss(model, input_ids.to(device), labels.to(device), precision) / count
        (loss * weight).backward()
        total = total + loss.detach()
    return total


def finetune_step(model, optimizer, rows: list, max_length: int, micro_batch: int | None,
                  precision: str = "fp32") -> torch.Tensor:
    """One optimiser step on ``rows`` (:func:`finetune_backward`, then the optimiser's step); the
    batch's loss, on the device. The trials run the same backward on the loop harness."""
    optimizer.zero_grad(set_to_none=True)
    total = finetune_backward(model, rows, max_length, micro_batch, precision)
    optimizer.step()
    return total
