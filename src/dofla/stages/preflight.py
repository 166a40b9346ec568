"""The memory preflight before the train stage: the predicted peaks of the train and distill stages
on this run's device, printed; a micro-batch that cannot fit is refused, naming the one that would
(before either stage trains); ``train.micro_batch_size=auto`` / ``distill.micro_batch_size=auto``
pick the largest that fits. Each prediction traces its stage's own step (:mod:`dofla.train.capacity`).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from dofla import distributed
from dofla.errors import DoflaError
from dofla.record import write_json
from dofla.stages.context import RunContext
from dofla.world import train_split

GIB = 2**30


def size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


class DoesNotFitError(DoflaError):
    """A training stage cannot fit the device at the configured micro-batch."""


def predict(ctx: RunContext, dims: list, micro_batch: int | None, batch: int):
    """The train stage's :class:`~dofla.train.capacity.Peak` at ``micro_batch`` (None: the whole batch)
    of this process's ``batch``; None when no layer has features to train (Performer's are random and
    fixed)."""
    from dofla.precision import teacher_dtype
    from dofla.stages.train import build_feature_maps, layer_train_config, linear_layers, make_student
    from dofla.train import capacity
    from dofla.train.losses import end_to_end

    cfg, teacher = ctx.cfg, ctx.teacher
    # the trace runs the eager loss (compiling inside the trace's dispatch mode would trace the
    # compiler); inductor's fused kernels usually hold fewer buffers, so the eager peak plans safe
    train_cfg = replace(layer_train_config(cfg), softcap=ctx.geometry.softcap, micro_batch_size=micro_batch,
                        compile=False, batch_size=batch)
    maps = build_feature_maps(cfg, ctx.geometry, dims)
    if end_to_end(cfg.loss.name):
        return capacity.direct_step_peak(
            lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), teacher,
            ctx.geometry.num_layers, train_cfg, cfg.data.seq_len, loaded_bytes(teacher, maps))
    layers = [i for i in linear_layers(cfg, ctx.geometry)
              if dims[i] and any(p.requires_grad for p in maps[i].parameters())]
    if not layers:
        return None
    dtype = getattr(torch, teacher_dtype(cfg.precision, cfg.train.teacher_dtype))
    if ctx.source == "stream":  # the teacher's distillation forwards run in its `dtype` copy
        return capacity.stream_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len,
                                         capacity.copy_bytes(teacher, dtype), dtype)
    return capacity.cached_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len, ctx.geometry)


def loaded_bytes(teacher, maps: list) -> int:
    """What stays loaded while the whole student trains: the teacher, and the student (the teacher's
    weights and every layer's features), counted without building the student."""
    from dofla.train import capacity

    return 2 * capacity.module_bytes(teacher) + sum(capacity.module_bytes(m) for m in maps if m is not None)


def predict_distill(ctx: RunContext, dims: list, micro_batch: int | None, batch: int):
    """The distill stage's :class:`~dofla.train.capacity.Peak` at ``micro_batch`` (None: the whole batch)
    of this process's ``batch``."""
    from dofla.stages.distill import schedule
    from dofla.stages.train import build_feature_maps, make_student
    from dofla.train import capacity

    cfg, teacher, d = ctx.cfg, ctx.teacher, ctx.cfg.distill
    return capacity.kl_step_peak(
        lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), teacher, ctx.geometry.num_layers,
        replace(schedule(ctx, 1), micro_batch_size=micro_batch), list(d.train), (d.lora_rank, d.lora_alpha),
        d.seq_len or cfg.data.seq_len, loaded_bytes(teacher, build_feature_maps(cfg, ctx.geometry, dims)), batch)


def run(ctx: RunContext, dims: list, plan=("train",)) -> RunContext:
    """Check the memory of the training stages in ``plan`` (train, distill) before either runs; returns
    ``ctx`` with their ``micro_batch_size`` resolved."""
    from dofla.train.losses import end_to_end

    cfg = ctx.cfg
    records = {}
    if "train" in plan and any(dims):
        # under torchrun direct (and a data-parallel stream) splits every batch over the processes; each
        # process traces its own share
        batch = cfg.train.direct_batch_size if end_to_end(cfg.loss.name) else cfg.train.batch_size
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
    if records and distributed.is_main():
        write_json(ctx.out_dir / "preflight.json", records)
    return ctx


def check(ctx: RunContext, stage: str, predict_at, batch: int, records: dict):
    """One stage's preflight (``<stage>.micro_batch_size``): prints its peak, records it in ``records``,
    refuses what cannot fit; returns the micro-batch to run (None: the whole batch)."""
    from dofla.train import capacity

    cfg = ctx.cfg
    setting = getattr(cfg, stage).micro_batch_size
    auto, name = setting == "auto", f"{stage}.micro_batch_size"
    if not (cfg.train.preflight or auto):
        return setting
    device = next(ctx.teacher.parameters()).device
    limit = int(cfg.train.memory_limit_gb * GIB) if cfg.train.memory_limit_gb else capacity.device_memory(device)
    where = f"{cfg.train.memory_limit_gb:g} GiB (train.memory_limit_gb)" if cfg.train.memory_limit_gb else \
        f"{size(limit)} usable on {device}"
    started = time.perf_counter()
    try:
        with distributed.alone():
            peak = predict_at(1)
    except Exception as err:  # noqa: BLE001 - an architecture the trace cannot cut: say so, train anyway
        if auto:
            raise DoesNotFitError(f"{name}=auto needs the memory preflight, which failed here "
                                  f"({type(err).__name__}: {err}); set {name} to a number") from err
        print(f"dofla: memory preflight of the {stage} stage skipped ({type(err).__name__}: {err})", flush=True)
        return setting
    if peak is None:  # nothing trains: no step to size
        return None if auto else setting
    fitting = capacity.largest_fitting(peak, batch, limit)
    micro = fitting if auto else (setting or batch)
    need = peak.at(micro or 1)
    split = "a batch of one sequence" if need.per_sample is None else \
        f"{size(need.fixed)} weights and optimiser state + {micro or 1} × {size(need.per_sample)} per sequence"
    print(f"dofla: memory preflight ({time.perf_counter() - started:.1f} s): the {stage} stage needs "
          f"≈ {size(need.bytes)} at micro-batch {micro or 1} ({split}); {where}", flush=True)
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
        print(f"dofla: {name}=auto: {micro} (of batch {batch})", flush=True)
    return micro if micro < batch else None
