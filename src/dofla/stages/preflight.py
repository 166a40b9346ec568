"""The memory preflight before the train stage: the predicted peaks of the train and distill stages
on this run's device, printed; a micro-batch that cannot fit is refused, naming the one that would
(before either stage trains); ``train.micro_batch_size=auto`` / ``distill.micro_batch_size=auto``
pick the largest that fits. Each prediction traces its stage's own step (:mod:`dofla.train.capacity`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from dofla import distributed
from dofla.errors import DoflaError
from dofla.eval.suite import expand_tasks, finetune_batch_sizes, finetune_micro_batch_sizes
from dofla.precision import teacher_dtype
from dofla.record import write_json
from dofla.stages.context import RunContext
from dofla.stages.parallel import train_split
from dofla.stages.plan import distill_schedule
from dofla.stages.students import build_feature_maps, layer_train_config, linear_layers, make_student
from dofla.train import capacity

logger = logging.getLogger(__name__)

GIB = 2**30


def size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


class DoesNotFitError(DoflaError):
    """A training stage cannot fit the device at the configured micro-batch."""


def predict(ctx: RunContext, dims: list, micro_batch: int | None, batch: int):
    """The train stage's :class:`~dofla.train.capacity.Peak` at ``micro_batch`` (None: the whole batch)
    of this process's ``batch``; None when no layer has features to train (Performer's are random and
    fixed)."""
    cfg, teacher = ctx.cfg, ctx.teacher
    # the trace runs the eager loss (compiling inside the trace's dispatch mode would trace the
    # compiler); inductor's fused kernels usually hold fewer buffers, so the eager peak plans safe
    train_cfg = replace(layer_train_config(cfg), softcap=ctx.geometry.softcap, micro_batch_size=micro_batch,
                        compile=False, batch_size=batch)
    maps = build_feature_maps(cfg, ctx.geometry, dims)
    if ctx.train.direct:
        return capacity.direct_step_peak(
            lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), teacher,
            ctx.geometry.num_layers, train_cfg, cfg.data.seq_len, loaded_bytes(teacher, maps))
    layers = [i for i in linear_layers(cfg, ctx.geometry)
              if dims[i] and any(p.requires_grad for p in maps[i].parameters())]
    if not layers:
        return None
    dtype = getattr(torch, teacher_dtype(cfg.precision, cfg.train.teacher_dtype))
    if ctx.train.streams:  # the teacher's distillation forwards run in its `dtype` copy
        return capacity.stream_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len,
                                         capacity.copy_bytes(teacher, dtype), dtype)
    return capacity.cached_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len, ctx.geometry)


def loaded_bytes(teacher, maps: list) -> int:
    """What stays loaded while the whole student trains: the teacher, and the student (the teacher's
    weights and every layer's features), counted without building the student."""
    return 2 * capacity.module_bytes(teacher) + sum(capacity.module_bytes(m) for m in maps if m is not None)


def predict_distill(ctx: RunContext, dims: list, micro_batch: int | None, batch: int):
    """The distill stage's :class:`~dofla.train.capacity.Peak` at ``micro_batch`` (None: the whole batch)
    of this process's ``batch``."""
    cfg, teacher, d = ctx.cfg, ctx.teacher, ctx.cfg.distill
    return capacity.kl_step_peak(
        lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), teacher, ctx.geometry.num_layers,
        replace(distill_schedule(ctx.cfg, 1), micro_batch_size=micro_batch), list(d.train), (d.lora_rank, d.lora_alpha),
        d.seq_len or cfg.data.seq_len, loaded_bytes(teacher, build_feature_maps(cfg, ctx.geometry, dims)), batch)


def run(ctx: RunContext, dims: list, plan=("train",), records: dict | None = None) -> RunContext:
    """Check the memory of the training stages in ``plan`` (train, distill, and the evaluation
    protocol's task fine-tunes) before any runs; returns ``ctx`` with their micro-batches resolved.
    ``records``: filled with each stage's prediction (also written to ``preflight.json``)."""
    cfg = ctx.cfg
    records = {} if records is None else records
    if "train" in plan and any(dims):
        # under torchrun direct (and a data-parallel stream) splits every batch over the processes; each
        # process traces its own share
        batch = cfg.train.direct_batch_size if ctx.train.direct else cfg.train.batch_size
        if train_split(cfg, distributed.world(), ctx.source) == "data":
            batch //= distributed.world()
        micro = check(ctx, "train", lambda m: predict(ctx, dims, m, batch), batch, records)
        if micro != cfg.train.micro_batch_size:
            ctx = replace(ctx, cfg=replace(ctx.cfg, train=replace(ctx.cfg.train, micro_batch_size=micro)))
    partial = cfg.train.layers is not None and len(set(cfg.train.layers)) < ctx.geometry.num_layers
    if cfg.distill.name != "none" and {"assemble", "distill"} <= set(plan) and not partial:
        batch = cfg.distill.batch_size // distributed.world()  # every rank trains on its rows of each batch
        micro = check(ctx, "distill", lambda m: predict_distill(ctx, dims, m, batch), batch, records)
        if micro != cfg.distill.micro_batch_size:
            ctx = replace(ctx, cfg=replace(ctx.cfg, distill=replace(ctx.cfg.distill, micro_batch_size=micro)))
    if "eval" in plan and cfg.eval.protocol == "finetune" and cfg.eval.tasks and not partial:
        ctx = check_task_finetune(ctx, dims, records)
    if records and distributed.is_main():
        write_json(ctx.out_dir / "preflight.json", records)
    return ctx


def memory_limit(ctx: RunContext) -> tuple[int, str]:
    """(bytes the preflight plans against, where they come from in words)."""
    cfg = ctx.cfg
    device = next(ctx.teacher.parameters()).device
    if cfg.train.memory_limit_gb:
        return int(cfg.train.memory_limit_gb * GIB), f"{cfg.train.memory_limit_gb:g} GiB (train.memory_limit_gb)"
    limit = capacity.device_memory(device)
    return limit, f"{size(limit)} usable on {device}" + (" (free now)" if device.type == "cuda" else "")


def check(ctx: RunContext, stage: str, predict_at, batch: int, records: dict):
    """One stage's preflight (``<stage>.micro_batch_size``): prints its peak, records it in ``records``,
    refuses what cannot fit; returns the micro-batch to run (None: the whole batch)."""
    cfg = ctx.cfg
    setting = getattr(cfg, stage).micro_batch_size
    auto, name = setting == "auto", f"{stage}.micro_batch_size"
    if not (cfg.train.preflight or auto):
        return setting
    limit, where = memory_limit(ctx)
    started = time.perf_counter()
    traced, peak = _trace(lambda: predict_at(1), name, auto, f"the {stage} stage")
    if not traced:
        return setting
    if peak is None:  # nothing trains: no step to size
        return None if auto else setting
    fitting = capacity.largest_fitting(peak, batch, limit)
    micro = fitting if auto else (setting or batch)
    need = peak.at(micro or 1)
    split = "a batch of one sequence" if need.per_sample is None else \
        f"{size(need.fixed)} weights and optimiser state + {micro or 1} × {size(need.per_sample)} per sequence"
    logger.info(f"dofla: memory preflight ({time.perf_counter() - started:.1f} s): the {stage} stage needs "
          f"≈ {size(need.bytes)} at micro-batch {micro or 1} ({split}); {where}")
    records[stage] = {"micro_batch": micro, "batch": batch, "fixed": peak.fixed, "per_sample": peak.per_sample,
                      "predicted": need.bytes, "limit": limit, "fits": fitting}
    if fitting is None:
        chunk = "distill.logit_chunk=256, " if stage == "distill" and not cfg.distill.logit_chunk else ""
        raise DoesNotFitError(f"the {stage} stage does not fit {where} even at micro-batch 1 (≈ {size(need.bytes)}); "
                              f"use {chunk}precision=bf16, a shorter sequence length, fewer features or a larger device")
    if micro > fitting:
        raise DoesNotFitError(f"{name}={micro} needs ≈ {size(need.bytes)}, more than {where}; "
                              f"{name}={fitting} fits (≈ {size(peak.at(fitting).bytes)}), "
                              f"or {name}=auto picks it")
    if auto:
        logger.info(f"dofla: {name}=auto: {micro} (of batch {batch})")
    return micro if micro < batch else None


def predict_task_finetune(ctx: RunContext, dims: list, batch: int):
    """The evaluation protocol's task fine-tune :class:`~dofla.train.capacity.Peak` (``eval`` stage): the
    larger of the teacher's and the student's, every row at ``eval.finetune_max_length`` tokens, with the
    teacher, the student (and the teacher's capture copy) loaded beside the working copy."""
    cfg, teacher = ctx.cfg, ctx.teacher
    maps = build_feature_maps(cfg, ctx.geometry, dims)
    features = sum(capacity.module_bytes(m) for m in maps if m is not None)
    capture = capacity.copy_bytes(teacher, getattr(torch, teacher_dtype(cfg.precision, cfg.train.teacher_dtype)))
    weights = loaded_bytes(teacher, maps) + capacity.module_bytes(teacher) + features + capture
    models = [lambda cut: cut, lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers])]
    return capacity.task_step_peak(models, teacher, ctx.geometry.num_layers, cfg.eval.finetune_max_length,
                                   cfg.precision, weights, 1, batch)


def check_task_finetune(ctx: RunContext, dims: list, records: dict) -> RunContext:
    """The preflight of the task fine-tunes (``eval.finetune_micro_batch_size``, per task): prints the
    peak at the micro-batch of the largest batch, refuses a micro-batch that cannot fit, resolves
    ``auto`` per task to the largest that fits; returns ``ctx`` with the resolved sizes."""
    ev, name = ctx.cfg.eval, "eval.finetune_micro_batch_size"
    batches, settings = finetune_batch_sizes(ev), finetune_micro_batch_sizes(ev)
    tasks = expand_tasks(list(ev.tasks))
    batch_of = {t: batches.get(t, batches["default"]) for t in tasks}
    setting_of = {t: settings.get(t, settings["default"]) for t in tasks}
    auto = "auto" in setting_of.values()
    if not (ctx.cfg.train.preflight or auto):
        return ctx
    limit, where = memory_limit(ctx)
    started = time.perf_counter()
    traced, peak = _trace(lambda: predict_task_finetune(ctx, dims, max(batch_of.values())), name, auto,
                          "the task fine-tunes")
    if not traced:
        return ctx
    chosen = {}
    for task in tasks:
        batch, setting = batch_of[task], setting_of[task]
        fitting = capacity.largest_fitting(peak, batch, limit)
        micro = fitting if setting == "auto" else (setting or batch)
        if fitting is None or micro > fitting:
            fix = "use a shorter eval.finetune_max_length, precision=bf16 or a larger device" if fitting is None \
                else f"{name}={{{task}: {fitting}}} fits, or {name}=auto picks it"
            raise DoesNotFitError(f"the task fine-tune of {task} needs ≈ {size(peak.at(micro or 1).bytes)} at "
                                  f"micro-batch {micro or 1}, more than {where}; {fix}")
        chosen[task] = micro if micro < batch else None
    largest = max(tasks, key=batch_of.get)
    micro = chosen[largest] or batch_of[largest]
    need = peak.at(micro)
    logger.info(f"dofla: memory preflight ({time.perf_counter() - started:.1f} s): the task fine-tunes need "
          f"≈ {size(need.bytes)} at micro-batch {micro} of {largest}'s {batch_of[largest]} ({size(need.fixed)} "
          f"models and optimiser state + {micro} × {size(need.per_sample or 0)} per sequence); {where}")
    records["eval"] = {"micro_batch": chosen, "batch": batch_of, "fixed": peak.fixed, "per_sample": peak.per_sample,
                       "predicted": need.bytes, "limit": limit}
    if not auto:
        return ctx
    logger.info(f"dofla: {name}=auto: " + ", ".join(f"{t} {chosen[t] or batch_of[t]}" for t in tasks))
    resolved = {**chosen, "default": min((m for m in chosen.values() if m), default=None)}
    return replace(ctx, cfg=replace(ctx.cfg, eval=replace(ev, finetune_micro_batch_size=resolved)))


def _trace(predict, name: str, auto: bool, what: str):
    """(True, ``predict()``), or (False, None) when the trace fails on an architecture it cannot cut: said
    in one sentence and the stage runs anyway, unless ``name`` is ``auto`` (which needs the trace)."""
    try:
        with distributed.alone():
            return True, predict()
    except Exception as err:  # noqa: BLE001 - an architecture the trace cannot cut: say so, run anyway
        if auto:
            raise DoesNotFitError(f"{name}=auto needs the memory preflight, which failed here "
                                  f"({type(err).__name__}: {err}); set {name} to a number") from err
        logger.warning(f"dofla: memory preflight of {what} skipped ({type(err).__name__}: {err})")
        return False, None
