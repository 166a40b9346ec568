"""Streaming layerwise training: a fresh teacher forward every step, no activation cache on disk.

Each step draws the next (B, L) token batch, runs the teacher once without gradients up to the
deepest layer still training (the capture callback raises a private exception there, so deeper
layers never run), then gives every trained layer its own loss and its own Adam step on that
layer's teacher q, k. The q, k are teacher activations, so no gradient crosses layers: this is
the paper's layerwise training, with data bounded by time instead of disk. Memory holds one batch.

Held-out loss on fixed held-out q, k every ``eval_every`` steps keeps each layer's best state (as
``train_layer`` does). Under torchrun with ``data_parallel``, every rank reads the same batches and
runs the teacher and the losses on its own rows of each (rank r takes rows r, r + N, ...), the
layers' gradients are averaged across the ranks, and rank 0's held-out values decide for all: N
processes give one process's steps at the same batch, with 1/N of its teacher and loss work each.

A checkpoint every ``checkpoint_every`` steps holds every layer's features, optimizer and best state
plus the data position, so a killed run resumes to the same bits on CPU.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Union

import torch
from tqdm.auto import tqdm

from dofla import distributed
from dofla.artifacts import load_artifact, load_checkpoint, save_artifact, torch_save_atomic
from dofla.data.sources import DataError
from dofla.data.stream import BatchStream, StreamExhausted
from dofla.faults import kill_point
from dofla.feature_maps.blocks import feature_dims
from dofla.models.adapters import get_adapter
from dofla.train.layerwise import (LayerTrainConfig, comparable_meta, cpu_state, heldout_loss, layer_loss, learnt,
                                   needs_values, param_groups)
from dofla.train.live import Live, Log, latest
from dofla.train.step import Accumulator, lr_factor, micro_batches
from dofla.train.teacher_acts import teacher_qk

# layer -> (q (S, H, L, d), k (S, H_kv, L, d)), or a callable giving them per layer
HeldOut = Union[dict, Callable[[int], tuple]]


@dataclass
class StreamResult:
    summaries: dict[int, dict]  # per layer, the keys run_layerwise's summaries have
    tokens: int  # tokens consumed (steps × B × L)
    steps_run: int
    seconds: float  # wall time of the whole run, resumed parts included
    teacher_seconds: float  # of which teacher forwards


def total_steps(num_tokens: int, steps: int | None, batch_tokens: int) -> int:
    """``steps`` when set (it wins), else one pass over ``num_tokens``: num_tokens // (B·L)."""
    if steps is not None:
        if steps < 1:
            raise ValueError(f"steps={steps} must be ≥ 1 (or None to use num_tokens)")
        return steps
    if num_tokens < batch_tokens:
        raise ValueError(f"num_tokens={num_tokens} is less than one batch ({batch_tokens} tokens); "
                         "raise num_tokens or lower the batch size / sequence length")
    return num_tokens // batch_tokens


def train_layers_streaming(teacher, batches: BatchStream, feature_maps: list, layers: list[int],
                           cfg: LayerTrainConfig, heldout: HeldOut, checkpoint_path: Path | None = None,
                           num_tokens: int = 0, steps: int | None = None, progress: bool = True,
                           meta: dict | None = None, on_log: Log | None = None,
                           data_parallel: bool = False) -> StreamResult:
    """Train ``feature_maps[i]`` for every i in ``layers`` on fresh teacher activations.

    Runs ``total_steps(num_tokens, steps, B·L)`` steps (cfg.steps is ignored; the warm-up and
    cosine schedule span this count). Feature maps move to the teacher's device. Returns per-layer
    summaries; each feature map ends holding its best held-out state. ``on_log`` gets each layer's
    latest loss, tokens/s and the ETA every ``cfg.log_every`` steps (:mod:`dofla.train.live`;
    losses reach the host only then). A checkpoint of a finished
    run makes a second call return at once with the same result. The checkpoint records ``meta``
    (the settings); one written with other settings is never resumed: training starts over.
    ``data_parallel``: under torchrun, split every batch over the ranks (every rank must call this
    with the same arguments; rank 0 writes the checkpoint).
    """
    dp = DataParallel(data_parallel)
    modules = get_adapter(teacher).attention_modules(teacher)
    layers = _checked_layers(layers, len(modules))
    total = total_steps(num_tokens, steps, batches.batch_tokens)
    cfg = replace(cfg, steps=total)
    device = next(teacher.parameters()).device
    optimizers, base_lrs = {}, {}
    for i in layers:
        groups = param_groups(feature_maps[i].to(device), cfg)
        if groups:
            optimizers[i] = torch.optim.Adam(groups, betas=(0.9, 0.999), weight_decay=0.0)
            base_lrs[i] = [g["lr"] for g in groups]
    meta = {"settings": meta, "train": learnt(asdict(cfg)), "layers": layers,
            "shape": [batches.batch_size, batches.seq_len]}
    ckpt = load_checkpoint(checkpoint_path, meta, normalize=comparable_meta)
    if ckpt is not None:
        state = _resume(ckpt, feature_maps, optimizers, batches)
    else:
        state = _initial_state(feature_maps, layers, optimizers, heldout, cfg, device, batches, dp)
    bar = tqdm(total=total * batches.batch_tokens, initial=state["tokens"], desc="stream", unit="tok",
               unit_scale=True, disable=not progress or not distributed.is_main())
    start = time.perf_counter() - state["seconds"]
    live = Live(on_log, cfg.log_every, total * batches.batch_tokens, state["tokens"], reduce=dp.mean)
    while state["step"] < total and _active(state):
        kill_point(f"stream:step{state['step']}")
        ids = _next_batch(batches, total)
        _train_step(teacher, modules, dp.rows(ids).to(device), feature_maps, optimizers, base_lrs, state, cfg, live,
                    dp.on)
        state["step"] += 1
        state["tokens"] += ids.numel()
        state["data"] = batches.state()
        if state["step"] % cfg.eval_every == 0 or state["step"] == total:
            live.flush()
            for i in _active(state):
                _evaluate(feature_maps[i], i, heldout, cfg, device, state, dp)
        state["seconds"] = time.perf_counter() - start
        if checkpoint_path is not None and state["step"] % cfg.checkpoint_every == 0:
            live.flush()
            if dp.main:
                _save(Path(checkpoint_path), feature_maps, optimizers, state, meta)
        bar.update(ids.numel())
        if live.due(state["step"], last=state["step"] == total):
            live.flush()
            values = latest({i: layer["curve"] for i, layer in state["layers"].items()})
            live.log(state["step"], state["tokens"], values)
            bar.set_postfix(step=state["step"], loss=f"{values.get('loss_mean', float('nan')):.4f}")
    bar.close()
    live.flush()
    if checkpoint_path is not None and dp.main:
        _save(Path(checkpoint_path), feature_maps, optimizers, state, meta)
    return _result(feature_maps, state)


def _checked_layers(layers: list[int], num_layers: int) -> list[int]:
    layers = sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"layers {layers} must be a non-empty subset of 0..{num_layers - 1} (the teacher's "
                         "layers); fix train.layers")
    return layers


class DataParallel:
    """A streamed run's share of torchrun's work: each rank's rows of a batch, the mean of logged
    values over the ranks, rank 0's held-out values; all no-ops when ``on`` is false or alone."""

    def __init__(self, on: bool):
        self.on = on and distributed.world() > 1
        self.main = distributed.is_main() if self.on else True

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        return distributed.my_rows(batch) if self.on else batch

    def mean(self, values: list[float]) -> list[float]:
        return distributed.mean_across(values) if self.on else values

    def agreed(self, value: float) -> float:
        return distributed.broadcast(value) if self.on else value


def _initial_state(feature_maps, layers, optimizers, heldout, cfg, device, batches, dp: DataParallel) -> dict:
    per_layer = {}
    for i in layers:
        initial = dp.agreed(_heldout_value(feature_maps[i], i, heldout, cfg, device))
        per_layer[i] = {"curve": [], "initial": initial, "best": initial, "best_step": 0, "bad_evals": 0,
                        "stopped": i not in optimizers, "seconds": 0.0, "best_state": cpu_state(feature_maps[i])}
    return {"step": 0, "tokens": 0, "seconds": 0.0, "teacher_seconds": 0.0, "data": batches.state(),
            "shape": (batches.batch_size, batches.seq_len), "layers": per_layer}


def _active(state) -> list[int]:
    return [i for i, s in state["layers"].items() if not s["stopped"]]


def _next_batch(batches: BatchStream, total: int) -> torch.Tensor:
    try:
        return batches.next_batch()
    except StreamExhausted as err:
        raise DataError(
            f"data source {batches.source!r} ran out after {err.tokens} tokens but this run needs "
            f"{total * batches.batch_tokens} ({total} steps of {batches.batch_size}×{batches.seq_len}); "
            "lower data.num_tokens (or set train.max_steps) or use a larger data source") from None


def _train_step(teacher, modules, ids, feature_maps, optimizers, base_lrs, state, cfg, live: Live,
                data_parallel: bool = False) -> None:
    """Per micro-batch one teacher forward and every active layer's loss and backward; then one Adam
    step per layer on the accumulated gradients (averaged over torchrun's ranks with ``data_parallel``;
    ``ids`` is then this rank's rows). The losses join the curves at ``live``'s next flush."""
    step, active = state["step"], _active(state)
    steps = {i: Accumulator(optimizers[i]) for i in active}
    for part, share in micro_batches(ids, cfg):
        started = time.perf_counter()
        acts = teacher_qk(teacher, modules, part, active, values=needs_values(cfg.loss))
        state["teacher_seconds"] += time.perf_counter() - started
        for i in active:
            started = time.perf_counter()
            q, k, v = acts.pop(i)  # frees this layer's activations before the next layer's step
            steps[i].add(layer_loss(feature_maps[i], q, k, cfg, v), share)
            state["layers"][i]["seconds"] += time.perf_counter() - started
    for i in active:
        started = time.perf_counter()
        for group, lr in zip(optimizers[i].param_groups, base_lrs[i]):
            group["lr"] = lr * lr_factor(step, cfg)
        loss = steps[i].step(f"layer{i}: non-finite training loss at streaming step {step}", cfg.skip_nonfinite,
                             data_parallel)
        curve = state["layers"][i]["curve"]
        if loss is not None:
            curve.append({"step": step, "loss": None})
            live.hold(curve[-1], "loss", loss)
        else:
            curve.append({"step": step, "loss": None, "skipped": True})
        state["layers"][i]["seconds"] += time.perf_counter() - started


def _heldout_value(feature_map, i: int, heldout: HeldOut, cfg, device) -> float:
    q, k, *v = (t.to(device, torch.float32) for t in (heldout[i] if isinstance(heldout, dict) else heldout(i)))
    return heldout_loss(feature_map, q, k, torch.arange(q.shape[0]), cfg, v[0] if v else None)


def _evaluate(feature_map, i: int, heldout: HeldOut, cfg, device, state, dp: DataParallel) -> None:
    """Record layer i's held-out loss, keep its best state, stop it when patience runs out (rank 0's
    value decides on every rank)."""
    layer = state["layers"][i]
    value = dp.agreed(_heldout_value(feature_map, i, heldout, cfg, device))
    layer["curve"][-1]["heldout_loss"] = value
    if value < layer["best"]:
        layer.update(best=value, best_step=state["step"], bad_evals=0, best_state=cpu_state(feature_map))
    else:
        layer["bad_evals"] += 1
        layer["stopped"] = cfg.patience > 0 and layer["bad_evals"] >= cfg.patience


def _save(path: Path, feature_maps, optimizers, state, meta: dict) -> None:
    torch_save_atomic({"feature_maps": {i: feature_maps[i].state_dict() for i in state["layers"]},
                       "optimizers": {i: opt.state_dict() for i, opt in optimizers.items()},
                       "rng": torch.get_rng_state(), "state": state, "meta": meta}, path)


def _resume(ckpt: dict, feature_maps, optimizers, batches: BatchStream) -> dict:
    for i, sd in ckpt["feature_maps"].items():
        feature_maps[i].load_state_dict(sd)
    for i, sd in ckpt["optimizers"].items():
        optimizers[i].load_state_dict(sd)
    torch.set_rng_state(ckpt["rng"])
    batches.restore(ckpt["state"]["data"])
    return ckpt["state"]


def _result(feature_maps, state) -> StreamResult:
    summaries = {}
    for i, layer in state["layers"].items():
        feature_maps[i].load_state_dict(layer["best_state"])
        summaries[i] = {"layer": i, "initial_heldout_loss": layer["initial"], "final_heldout_loss": layer["best"],
                        "best_step": layer["best_step"], "steps_run": len(layer["curve"]),
                        "seconds": layer["seconds"], "curve": layer["curve"]}
    return StreamResult(summaries=summaries, tokens=state["tokens"], steps_run=state["step"],
                        seconds=state["seconds"], teacher_seconds=state["teacher_seconds"])


def run_streaming(teacher, batches: BatchStream, feature_maps: list, layers: list[int], cfg: LayerTrainConfig,
                  heldout: HeldOut, out_dir: Path, meta: dict | None = None, num_tokens: int = 0,
                  steps: int | None = None, on_log: Log | None = None, data_parallel: bool = False) -> dict[int, dict]:
    """``train_layers_streaming`` written as run_layerwise's verified ``layer_XX.pt`` artifacts.

    Layers whose artifact exists and verifies (same ``meta``) are loaded; the others train
    together from a checkpoint named after their set (so jobs on disjoint layers can share
    ``out_dir``). When all exist nothing runs. ``data_parallel``: torchrun's ranks share every
    batch (see :func:`train_layers_streaming`) and rank 0 writes the artifacts.
    """
    out_dir = Path(out_dir)
    metas = {i: {**(meta or {}), "layer": i, "num_features": feature_dims(feature_maps[i])} for i in layers}
    summaries, missing = {}, []
    for i in layers:
        found = load_artifact(out_dir / f"layer_{i:02d}.pt", metas[i])
        if found is None:
            missing.append(i)
        else:
            feature_maps[i].load_state_dict(found["state_dict"])
            summaries[i] = found["summary"]
    if not missing:
        return summaries
    checkpoint = out_dir / f"stream_{zlib.crc32(repr(sorted(missing)).encode()):08x}.ckpt"
    result = train_layers_streaming(teacher, batches, feature_maps, missing, cfg, heldout, checkpoint,
                                    num_tokens=num_tokens, steps=steps, on_log=on_log, data_parallel=data_parallel,
                                    meta={i: metas[i] for i in missing} if meta is not None else None)
    writes = not data_parallel or distributed.is_main()  # data parallel: every rank holds the same features
    for i, summary in result.summaries.items():
        summary["tokens"] = result.tokens
        if writes:
            save_artifact(out_dir / f"layer_{i:02d}.pt", {"state_dict": feature_maps[i].state_dict(),
                                                          "curve": summary["curve"], "summary": summary}, metas[i])
        summaries[i] = summary
    if writes:
        checkpoint.unlink(missing_ok=True)
    if data_parallel:
        distributed.barrier()
    return {i: summaries[i] for i in layers}
