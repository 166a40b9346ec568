"""One switch for the arithmetic of training: ``precision=fp32 | tf32 | bf16``.

- ``fp32``: everything in float32 (the ``l2`` loss in float64), as every result in docs/results was made.
- ``tf32``: float32 tensors, but CUDA matmuls on TensorFloat-32 (Ampere and newer; a no-op on CPU).
- ``bf16``: the teacher's distillation forwards run in a bfloat16 copy (unless ``train.teacher_dtype``
  says otherwise), and every training computation (layer losses, the student's forwards in ``direct``,
  ``distill`` and ``finetune``) runs under bfloat16 autocast. The trained parameters stay float32
  (master weights) and the losses keep their log-space math (autocast runs softmax, log-sum-exp and
  reductions in float32). Evaluation always runs in float32, so numbers compare across precisions;
  the fine-tunes of the evaluation protocol (``eval.protocol=finetune``) train under it like the rest.

``precision=auto`` (the paper experiments' setting) is tf32 where the run's device is a GPU and fp32
on the CPU, resolved before anything loads (:func:`resolve`) and printed.
"""
from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "tf32", "bf16")
SETTINGS = (*PRECISIONS, "auto")


def resolve(precision: str, device: str = "auto") -> str:
    """``auto``: tf32 when the run's ``device`` (auto, cpu, cuda, cuda:N) is a GPU, else fp32; any other
    setting as it is."""
    if precision != "auto":
        return precision
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "tf32" if gpu else "fp32"


def autocast(precision: str, device: torch.device | str):
    """bfloat16 autocast on ``device`` for ``bf16``; nothing for ``fp32`` / ``tf32``."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def configure_matmul(precision: str) -> None:
    """TensorFloat-32 matmuls for ``tf32`` (process-wide), full float32 otherwise."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def teacher_dtype(precision: str, configured: str) -> str:
    """The dtype of the teacher's distillation forwards: ``train.teacher_dtype`` when it is set to a
    half type, else bfloat16 under ``bf16`` and float32 otherwise."""
    if configured != "float32" or precision != "bf16":
        return configured
    return "bfloat16"
