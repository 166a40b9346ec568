"""The memory preflight before the train stage: its predicted peak on this run's device, printed;
a micro-batch that cannot fit is refused, naming the one that would; ``train.micro_batch_size=auto``
picks the largest that fits. The prediction traces the stage's own step (:mod:`dofla.train.capacity`).
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
    """The train stage cannot fit the device at the configured micro-batch."""


def predict(ctx: RunContext, dims: list, micro_batch: int | None):
    """The train stage's :class:`~dofla.train.capacity.Peak` at ``micro_batch`` (None: the whole batch);
    None when no layer has features to train (Performer's are random and fixed)."""
    from dofla.precision import teacher_dtype
    from dofla.stages.train import build_feature_maps, layer_train_config, linear_layers, make_student
    from dofla.train import capacity
    from dofla.train.losses import end_to_end

    cfg, teacher = ctx.cfg, ctx.teacher
    # the trace runs the eager loss (compiling inside the trace's dispatch mode would trace the
    # compiler); inductor's fused kernels usually hold fewer buffers, so the eager peak plans safe
    train_cfg = replace(layer_train_config(cfg), softcap=ctx.geometry.softcap, micro_batch_size=micro_batch,
                        compile=False)
    if end_to_end(cfg.loss.name):
        student = make_student(cfg, teacher, dims)
        return capacity.direct_step_peak(
            lambda cut: make_student(cfg, cut, dims[: cut.config.num_hidden_layers]), teacher,
            ctx.geometry.num_layers, replace(train_cfg, batch_size=cfg.train.direct_batch_size), cfg.data.seq_len,
            capacity.module_bytes(teacher) + capacity.module_bytes(student))
    maps = build_feature_maps(cfg, ctx.geometry, dims)
    layers = [i for i in linear_layers(cfg, ctx.geometry)
              if dims[i] and any(p.requires_grad for p in maps[i].parameters())]
    if not layers:
        return None
    dtype = getattr(torch, teacher_dtype(cfg.precision, cfg.train.teacher_dtype))
    if ctx.source == "stream":  # the teacher's distillation forwards run in its `dtype` copy
        return capacity.stream_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len,
                                         capacity.copy_bytes(teacher, dtype), dtype)
    return capacity.cached_step_peak(teacher, maps, layers, train_cfg, cfg.data.seq_len, ctx.geometry)


def run(ctx: RunContext, dims: list) -> RunContext:
    """Check the train stage's memory; returns ``ctx`` with ``train.micro_batch_size`` resolved."""
    from dofla.train import capacity
    from dofla.train.losses import end_to_end

    cfg = ctx.cfg
    auto = cfg.train.micro_batch_size == "auto"
    if not (cfg.train.preflight or auto) or not any(dims):
        return ctx
    # under torchrun direct (and a data-parallel stream) splits every batch over the processes; each
    # process traces its own share
    batch = cfg.train.direct_batch_size if end_to_end(cfg.loss.name) else cfg.train.batch_size
    if train_split(cfg, distributed.world(), ctx.source) == "data":
        batch //= distributed.world()
    device = next(ctx.teacher.parameters()).device
    limit = int(cfg.train.memory_limit_gb * GIB) if cfg.train.memory_limit_gb else capacity.device_memory(device)
    where = f"{cfg.train.memory_limit_gb:g} GiB (train.memory_limit_gb)" if cfg.train.memory_limit_gb else \
        f"{size(limit)} usable on {device}"
    started = time.perf_counter()
    try:
        with distributed.alone():
            peak = predict(ctx, dims, 1)
    except Exception as err:  # noqa: BLE001 - an architecture the trace cannot cut: say so, train anyway
        if auto:
            raise DoesNotFitError(f"train.micro_batch_size=auto needs the memory preflight, which failed here "
                               f"({type(err).__name__}: {err}); set train.micro_batch_size to a number") from err
        print(f"dofla: memory preflight skipped ({type(err).__name__}: {err})", flush=True)
        return ctx
    if peak is None:  # nothing trains: no step to size
        return replace(ctx, cfg=replace(cfg, train=replace(cfg.train, micro_batch_size=None))) if auto else ctx
    fitting = capacity.largest_fitting(peak, batch, limit)
    micro = fitting if auto else (cfg.train.micro_batch_size or batch)
    need = peak.at(micro or 1)
    print(f"dofla: memory preflight ({time.perf_counter() - started:.1f} s): the train stage needs "
          f"≈ {size(need.bytes)} at micro-batch {micro or 1} ({size(need.fixed)} weights and optimiser state + "
          f"{micro or 1} × {size(need.per_sample)} per sequence); {where}", flush=True)
    if distributed.is_main():
        write_json(ctx.out_dir / "preflight.json", {"stage": "train", "micro_batch": micro, "batch": batch,
                                                   "fixed": peak.fixed, "per_sample": peak.per_sample,
                                                   "predicted": need.bytes, "limit": limit, "fits": fitting})
    if fitting is None:
        raise DoesNotFitError(f"the train stage does not fit {where} even at micro-batch 1 (≈ {size(need.bytes)}); "
                              "use precision=bf16, a shorter data.seq_len, fewer features or a larger device")
    if micro > fitting:
        raise DoesNotFitError(f"train.micro_batch_size={micro} needs ≈ {size(need.bytes)}, more than {where}; "
                              f"train.micro_batch_size={fitting} fits (≈ {size(peak.at(fitting).bytes)}), "
                              "or train.micro_batch_size=auto picks it")
    if auto:
        print(f"dofla: train.micro_batch_size=auto: {micro} (of batch {batch})", flush=True)
    return replace(ctx, cfg=replace(cfg, train=replace(cfg.train, micro_batch_size=micro if micro < batch else None)))
