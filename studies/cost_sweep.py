"""The evaluation protocol's share of a paper sweep and the sweep's total, on one GPU
(``python -m studies.cost_model --sweeps``, :mod:`studies.cost_model`).

The task fine-tune step (:func:`dofla.train.probe_steps.task_step`: every parameter, AdamW, rows of
512 tokens that are all targets) is counted like a distillation step: on 1- and 2-layer cuts of the
teacher and of its student, one sequence, FLOPs by dtype and bytes written, extrapolated to the whole
model. Its tokens are a bound: every training example of the seven tasks (the paper's split sizes,
``dofla.eval.downstream.TRAIN_EXAMPLES``; MMLU's auxiliary_train once, the others three epochs) at
512 tokens. A sweep = every cell's distillation + every cell's student fine-tunes + the teacher's grid
once (six rates). lm-eval's scoring after each epoch, Algorithm 1 and data loading are not counted.
"""
from __future__ import annotations

import time
from dataclasses import replace

from dofla.gpucheck_cells import EPOCHS, GRID, SWEEPS
from dofla.eval import TRAIN_EXAMPLES
from dofla.train import capacity, configure_matmul, probe_steps
from studies.cost_ops import GPUS, CellCost, Seconds, counted_cuts, fmt_time, seconds, student_of

DISTILL_TOKENS = 362e6  # one pass over 10 % of English Wikipedia (studies.cost_model.PAPER_TOKENS)
FINETUNE_LENGTH = 512  # eval.finetune_max_length
FINETUNE_BATCH = 128  # MMLU's batch, the largest of paper_common's eval.finetune_batch_size
EVAL_TOKENS = sum(n * EPOCHS[task] * FINETUNE_LENGTH for task, n in TRAIN_EXAMPLES.items())


def eval_costs(t, precision: str, memory: bool = True) -> list:
    """The task fine-tune's :class:`studies.cost_model.CellCost` for the teacher and its student
    (loss ``finetune:teacher`` / ``finetune:student``), per token of rows at 512 tokens."""
    from studies.paper_memory import on_meta

    configure_matmul(precision)
    teacher = on_meta(t.config())
    depth = teacher.config.num_hidden_layers
    models = {"teacher": lambda cut: cut, "student": student_of(t)}
    out = []
    for who, of in models.items():
        started = time.perf_counter()
        step = probe_steps.task_step(of, teacher, FINETUNE_LENGTH, precision, steps=1)
        ops = counted_cuts(step, (t.name, f"finetune:{who}", precision))
        per_token = 1 / FINETUNE_LENGTH
        kinds = sorted({op.kind for n in ops for op in ops[n] if op.flops})
        flops = {k: per_token * capacity.in_depth(*(sum(o.flops for o in ops[n] if o.kind == k) for n in (1, 2)), depth)
                 for k in kinds}
        written = per_token * capacity.in_depth(*(sum(o.written for o in ops[n]) for n in (1, 2)), depth)
        per_gpu = {}
        for gpu in GPUS:
            one, two = (seconds(ops[n], gpu, precision) for n in (1, 2))
            per_gpu[gpu.name] = Seconds(*(per_token * capacity.in_depth(getattr(one, f), getattr(two, f), depth)
                                          for f in ("matmul", "traffic", "floor")))
        cost = CellCost(replace(t, seq_len=FINETUNE_LENGTH, batch=FINETUNE_BATCH), f"finetune:{who}", precision,
                        flops, written, per_gpu, count_seconds=time.perf_counter() - started)
        if memory:
            weights = 3 * capacity.module_bytes(teacher)  # teacher, student and the working copy
            cost.peak = capacity.task_step_peak([of], teacher, depth, FINETUNE_LENGTH, precision, weights, 1,
                                                FINETUNE_BATCH)
            cost.fits = {gpu.name: capacity.largest_fitting(cost.peak, FINETUNE_BATCH, capacity.usable(gpu.memory))
                         for gpu in GPUS}
        out.append(cost)
    configure_matmul("fp32")
    return out


def sweep_parts(costs: list, teacher: str, precision: str, gpu: str, mfu: float) -> tuple[float, float, float] | None:
    """(hours of every cell's distillation, of every cell's student fine-tunes, of the teacher's grid)
    of ``teacher``'s paper sweep on ``gpu`` at ``mfu``; None unless every step it needs was counted."""
    counts = SWEEPS[teacher]
    by = {(c.teacher.name, c.loss, c.precision): c for c in costs}
    losses = [loss for loss in counts if loss != "cells"]
    needed = [(teacher, loss, precision) for loss in losses] + \
        [(teacher, f"finetune:{who}", precision) for who in ("teacher", "student")]
    if not all(key in by for key in needed):
        return None

    def hours(key, tokens):
        return by[key].per_gpu[gpu].predicted(mfu) * tokens / 3600

    train = sum(counts[loss] * hours((teacher, loss, precision), DISTILL_TOKENS) for loss in losses)
    students = counts["cells"] * hours((teacher, "finetune:student", precision), EVAL_TOKENS)
    return train, students, GRID * hours((teacher, "finetune:teacher", precision), EVAL_TOKENS)


def sweep_table(costs: list, mfu: float) -> str:
    """Per teacher, precision and GPU: the sweep's distillation, its student fine-tunes, the teacher's
    grid and the total, at ``mfu``; a row only where every step the sweep runs was counted."""

    lines = [f"| teacher | cells | precision | GPU | distillation, all cells | student fine-tunes, all cells "
             f"| teacher's grid ({GRID} rates, once) | sweep total @ {mfu:.0%} MFU |", "|---|---|---|---|---|---|---|---|"]
    for teacher, counts in SWEEPS.items():
        for precision in ("fp32", "tf32", "bf16"):
            for gpu in GPUS:
                parts = sweep_parts(costs, teacher, precision, gpu.name, mfu)
                if parts is not None:
                    lines.append(f"| {teacher} | {counts['cells']} | {precision} | {gpu.name} | "
                                 + " | ".join(fmt_time(h) for h in (*parts, sum(parts))) + " |")
    return "\n".join(lines)
