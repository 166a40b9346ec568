"""One optimiser step of next-token training on (context, continuation) pairs, the continuation alone
scored: the step of the fine-tune protocol (:mod:`dofla.eval.task_finetune`), here below it so that the
memory probes of every training step (:mod:`dofla.train.probe_steps`) can run it too."""
from __future__ import annotations

import torch

from dofla.precision import autocast


def pad_batch(pairs, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded: with causal attention the padding never reaches a real
    token, so no attention mask is needed (linear-attention students may ignore one anyway)."""
    rows = []
    for context, continuation in pairs:
        ids = (context + continuation)[-max_length:]  # drop the oldest context tokens first
        n_target = min(len(continuation), len(ids) - 1)
        rows.append((ids, [-100] * (len(ids) - n_target) + ids[len(ids) - n_target :]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return input_ids, labels


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
