"""The startup prediction of a cell's time on its own device: every stage it runs (the teacher's pass
for the activation cache, train, distill, the evaluation protocol's task fine-tunes) and what a sweep of
such cells costs, the teacher's grid counted once.

Each training stage's own step (:mod:`dofla.train.probe_steps`) runs on 1- and 2-layer cuts of the
teacher on the run's device, at the run's sequence length, micro-batch and precision: one warm-up
call, then one timed call with the device synchronised before and after. A stack of identical
layers is affine in depth, so the whole model's step time follows, as the memory preflight
extrapolates memory. A stage's time is its steps × micro-batches per step × that time. Not counted:
Algorithm 1, assembling, held-out evaluation, lm-eval's scoring after each fine-tune epoch, data
loading. The task fine-tunes are bounded above: every row is taken at ``eval.finetune_max_length``
tokens (a batch pads to its widest row), and a task's training examples are the paper's split sizes
(:data:`dofla.eval.downstream.TRAIN_EXAMPLES`) or ``eval.finetune_train_limit``.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import torch

from dofla import distributed
from dofla.eval.downstream import TRAIN_EXAMPLES
from dofla.eval.suite import expand_tasks, finetune_batch_sizes, finetune_micro_batch_sizes
from dofla.measure import teacher_tokens_per_second
from dofla.precision import teacher_dtype
from dofla.stages.context import RunContext
from dofla.stages.plan import distill_schedule
from dofla.stages.sources import stream_steps
from dofla.stages.students import build_feature_maps, layer_train_config, linear_layers, make_student
from dofla.train import probe_steps
from dofla.train.capacity import in_depth, quiet

logger = logging.getLogger(__name__)


@dataclass
class StageTime:
    stage: str
    seconds: float
    what: str
    shared: bool = False  # once per sweep (the teacher's grid), not per cell


def timed(step, layers: int, micro: int, device: torch.device) -> float:
    """Seconds of one call of ``step(depth, micro)`` at depth ``layers``, from timed calls at depths 1 and 2."""
    seconds = []
    for depth in (1, 2):
        run = step(depth, micro)
        with quiet():
            run()  # warm-up: kernels chosen, memory pooled, lazy modules built
            synchronize(device)
            started = time.perf_counter()
            run()
            synchronize(device)
        seconds.append(time.perf_counter() - started)
    return max(seconds[0], in_depth(seconds[0], seconds[1], layers))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predict(ctx: RunContext, dims: list, plan) -> list[StageTime]:
    """The predicted time of every stage of ``plan`` this module can time (see the module's note)."""
    cfg, device = ctx.cfg, next(ctx.teacher.parameters()).device
    out = []
    if "cache" in plan:
        tokens = ctx.train.ledger.cached
        rate = teacher_tokens_per_second(ctx.capture, cfg.data.seq_len)
        out.append(StageTime("cache", tokens / rate, f"the teacher's pass over {tokens:,} tokens"))
    if "train" in plan and any(dims):
        out += train_time(ctx, dims, device)
    if cfg.distill.name != "none" and "distill" in plan:
        out += distill_time(ctx, dims, device)
    if "eval" in plan and cfg.eval.protocol == "finetune" and cfg.eval.tasks:
        out += finetune_time(ctx, dims, device)
    return out


def train_time(ctx: RunContext, dims: list, device) -> list[StageTime]:
    cfg, L, n = ctx.cfg, ctx.cfg.data.seq_len, ctx.geometry.num_layers
    direct, streams = ctx.train.direct, ctx.train.streams
    batch = cfg.train.direct_batch_size if direct else cfg.train.batch_size
    micro = cfg.train.micro_batch_size or batch
    train_cfg = replace(layer_train_config(cfg), softcap=ctx.geometry.softcap, compile=False, batch_size=micro,
                        micro_batch_size=None)
    maps = build_feature_maps(cfg, ctx.geometry, dims)
    if direct:
        step = probe_steps.direct_step(lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]),
                                       ctx.teacher, train_cfg, L, steps=1, device=device)
        steps, depth = (stream_steps(cfg, batch * L) if streams else cfg.train.steps), n
    else:
        layers = [i for i in linear_layers(cfg, ctx.geometry) if dims[i] and list(maps[i].parameters())]
        if not layers:
            return []
        if streams:
            dtype = getattr(torch, teacher_dtype(cfg.precision, cfg.train.teacher_dtype))
            step = probe_steps.stream_step(ctx.teacher, maps, layers, train_cfg, L, dtype, steps=1, device=device)
            steps, depth = stream_steps(cfg, batch * L), len(layers)
        else:  # each layer trains train.steps on its own (a cached step call runs two)
            step = probe_steps.cached_step(maps, layers, train_cfg, L, ctx.geometry, device)
            steps, depth = cfg.train.steps * len(layers), 1
    per_step = timed(step, depth, micro, device) / (1 if direct or streams else 2)
    per_step *= math.ceil(batch / micro)
    return [StageTime("train", steps * per_step, f"{steps:,.0f} steps of {batch} × {L} tokens")]


def distill_time(ctx: RunContext, dims: list, device) -> list[StageTime]:
    cfg, d = ctx.cfg, ctx.cfg.distill
    L = d.seq_len or cfg.data.seq_len
    micro = d.micro_batch_size or d.batch_size
    step = probe_steps.kl_step(lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), ctx.teacher,
                               distill_schedule(ctx.cfg, 1), list(d.train), (d.lora_rank, d.lora_alpha), L, device)
    steps = max(1, d.tokens // (d.batch_size * L))
    per_step = timed(step, ctx.geometry.num_layers, micro, device) / 2 * math.ceil(d.batch_size / micro)
    return [StageTime("distill", steps * per_step, f"{steps:,} steps of {d.batch_size} × {L} tokens")]


def finetune_time(ctx: RunContext, dims: list, device) -> list[StageTime]:
    """The task fine-tunes: the teacher's grid (every rate of ``eval.finetune_lr_grid``, once per
    sweep) and the student's fine-tune at the picked rate (every cell), an upper bound."""
    cfg, ev = ctx.cfg, ctx.cfg.eval
    length, n = ev.finetune_max_length, ctx.geometry.num_layers
    batches, micros = finetune_batch_sizes(ev), finetune_micro_batch_sizes(ev)
    models = {"teacher": lambda cut: cut,
              "student": lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers])}
    seconds, unknown, step_time = dict.fromkeys(models, 0.0), [], {}
    for task in expand_tasks(list(ev.tasks)):
        examples = min(TRAIN_EXAMPLES.get(task, math.inf), ev.finetune_train_limit or math.inf)
        if examples == math.inf:
            unknown.append(task)
            continue
        batch = batches.get(task, batches["default"])
        micro = micros.get(task, micros["default"])
        micro = batch if micro in (None, "auto") else micro
        epochs = 1 if task == "mmlu" else ev.finetune_epochs
        for who, of in models.items():
            if (who, micro) not in step_time:  # a step's time depends on its micro-batch only
                step = probe_steps.task_step(of, ctx.teacher, length, cfg.precision, steps=1, device=device)
                step_time[who, micro] = timed(step, n, micro, device)
            seconds[who] += epochs * math.ceil(examples / batch) * math.ceil(batch / micro) * step_time[who, micro]
    note = f" (not counted: {', '.join(unknown)}, whose training split's size is not known before it is read)" \
        if unknown else ""
    grid = len(ev.finetune_lr_grid)
    return [StageTime("eval_grid", grid * seconds["teacher"], f"the teacher's grid, {grid} rates{note}", shared=True),
            StageTime("eval", seconds["student"], f"the student's task fine-tunes{note}")]


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def run(ctx: RunContext, dims: list, plan, predicted: dict | None = None) -> list[StageTime]:
    """Print the cell's predicted time per stage, the cell's total and a sweep's; ``predicted``: gets
    ``{stage: {"seconds": ...}}`` (for metrics.json). The random state is left as it was, so the
    estimate changes nothing the run computes."""
    device = next(ctx.teacher.parameters()).device
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), distributed.alone():
        times = predict(ctx, dims, plan)
    if not times or not distributed.is_main():
        return times
    cell = sum(t.seconds for t in times if not t.shared)
    shared = sum(t.seconds for t in times if t.shared)
    parts = "; ".join(f"{t.stage} ≈ {hours(t.seconds)} ({t.what})" for t in times)
    logger.info(f"dofla: predicted time on {device} ({time.perf_counter() - started:.1f} s to time the steps): {parts}; "
          f"this cell ≈ {hours(cell + shared)}" + (f", a sweep of n such cells ≈ n × {hours(cell)} + "
                                                  f"{hours(shared)} (the teacher's grid once)" if shared else ""))
    for t in times:
        (predicted if predicted is not None else {}).setdefault(t.stage, {})["seconds"] = t.seconds
    return times
