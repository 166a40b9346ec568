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
plus the data position, so a killed run resumes to the same bits on CPU (the loop, its checkpoints
and the best states are :mod:`dofla.train.loop`'s).
"""
from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Union

import torch

from dofla import distributed
from dofla.artifacts import load_artifact, save_artifact
from dofla.data.sources import DataError
from dofla.data.stream import BatchStream, StreamExhausted
from dofla.feature_maps.blocks import feature_dims
from dofla.models.adapters import get_adapter
from dofla.train.layerwise import (LayerTrainConfig, comparable_meta, heldout_loss, layer_loss, learnt, needs_values,
                                   param_groups)
from dofla.train.live import Live, Log
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, optimiser_step, run_loop
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


class StreamedLayers(Trainer):
    """Every trained layer on fresh teacher activations: per micro-batch one teacher forward up to the
    deepest active layer, then each layer's loss on its own q, k (popped, so freed before the next
    layer's); the held-out q, k are fixed; the data position is the stream's."""

    kill = "stream:step"

    def __init__(self, teacher, units: dict[int, Unit], cfg: LayerTrainConfig, batches: BatchStream | None = None,
                 heldout: HeldOut | None = None, dp: DataParallel | None = None, modules=None):
        self.teacher, self.units, self.batches, self.cfg, self.held = teacher, units, batches, cfg, heldout
        self.dp = dp or DataParallel(False)
        self.modules = modules if modules is not None else get_adapter(teacher).attention_modules(teacher)
        self.device = next(teacher.parameters()).device
        self.batch_tokens = batches.batch_tokens if batches is not None else 0
        self.teacher_seconds, self.acts = 0.0, {}

    @classmethod
    def units_of(cls, feature_maps: list, layers: list[int], cfg: LayerTrainConfig, device) -> dict[int, Unit]:
        """One unit per layer, its features moved to ``device`` (a layer without parameters is stopped)."""
        units = {}
        for i in layers:
            groups = param_groups(feature_maps[i].to(device), cfg)
            optimizer = torch.optim.Adam(groups, betas=(0.9, 0.999), weight_decay=0.0) if groups else None
            units[i] = Unit(feature_maps[i], optimizer)
        return units

    def next_batch(self, step: int) -> torch.Tensor:
        return self.dp.rows(_next_batch(self.batches, self.cfg.steps)).to(self.device)

    def forward(self, rows: torch.Tensor, keys: list) -> None:
        started = time.perf_counter()
        self.acts = teacher_qk(self.teacher, self.modules, rows, keys, values=needs_values(self.cfg.loss))
        self.teacher_seconds += time.perf_counter() - started

    def loss(self, key, rows: torch.Tensor) -> torch.Tensor:
        q, k, v = self.acts.pop(key)  # frees this layer's activations before the next layer's step
        return layer_loss(self.units[key].module, q, k, self.cfg, v)

    def heldout(self, key) -> float:
        return _heldout_value(self.units[key].module, key, self.held, self.cfg, self.device)

    def data_state(self):
        return {"stream": self.batches.state(), "teacher_seconds": self.teacher_seconds}

    def restore_data(self, state) -> None:
        self.batches.restore(state["stream"])
        self.teacher_seconds = state["teacher_seconds"]

    def message(self, key, step: int) -> str:
        return f"layer{key}: non-finite training loss at streaming step {step}"


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
    with the same arguments; rank 0 writes the checkpoint). The loop is :func:`dofla.train.loop.run_loop`'s.
    """
    dp = DataParallel(data_parallel)
    layers = _checked_layers(layers, len(get_adapter(teacher).attention_modules(teacher)))
    cfg = replace(cfg, steps=total_steps(num_tokens, steps, batches.batch_tokens))
    units = StreamedLayers.units_of(feature_maps, layers, cfg, next(teacher.parameters()).device)
    trainer = StreamedLayers(teacher, units, cfg, batches, heldout, dp)
    meta = {"settings": meta, "train": learnt(asdict(cfg)), "layers": layers,
            "shape": [batches.batch_size, batches.seq_len]}
    done = run_loop(trainer, LoopConfig.of(cfg), Checkpointing(checkpoint_path, meta, comparable_meta, keep_final=True),
                    on_log, dp.on, desc="stream", progress=progress)
    summaries = {i: {"layer": i, "initial_heldout_loss": r["initial"], "final_heldout_loss": r["best"],
                     "best_step": r["best_step"], "steps_run": len(r["curve"]), "seconds": r["seconds"],
                     "curve": r["curve"]} for i, r in done.records.items()}
    return StreamResult(summaries=summaries, tokens=done.tokens, steps_run=done.step, seconds=done.seconds,
                        teacher_seconds=trainer.teacher_seconds)


def _train_step(teacher, modules, ids, feature_maps, optimizers, base_lrs, state, cfg, live: Live,
                data_parallel: bool = False) -> None:
    """One streamed step of ``state``'s active layers on ``ids`` outside the loop, its curves and times
    added to ``state`` (``{"step", "teacher_seconds", "layers": {i: {"stopped", "seconds", "curve"}}}``):
    the loop's own step (:func:`dofla.train.loop.optimiser_step`), as the memory preflight traces it."""
    units = {i: Unit(feature_maps[i], optimizers.get(i), base_lrs=list(base_lrs.get(i, [])), record=record)
             for i, record in state["layers"].items()}
    trainer = StreamedLayers(teacher, units, cfg, modules=modules)
    active = [i for i, unit in units.items() if not unit.record["stopped"]]
    optimiser_step(trainer, ids, active, cfg, state["step"], live, data_parallel)
    state["teacher_seconds"] += trainer.teacher_seconds


def _checked_layers(layers: list[int], num_layers: int) -> list[int]:
    layers = sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"layers {layers} must be a non-empty subset of 0..{num_layers - 1} (the teacher's "
                         "layers); fix train.layers")
    return layers


class DataParallel:
    """A streamed run's share of torchrun's work: each rank's rows of a batch; a no-op when ``on`` is
    false or alone (the loop averages the gradients and agrees on the held-out values)."""

    def __init__(self, on: bool):
        self.on = on and distributed.world() > 1

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        return distributed.my_rows(batch) if self.on else batch


def _next_batch(batches: BatchStream, total: int) -> torch.Tensor:
    try:
        return batches.next_batch()
    except StreamExhausted as err:
        raise DataError(
            f"data source {batches.source!r} ran out after {err.tokens} tokens but this run needs "
            f"{total * batches.batch_tokens} ({total} steps of {batches.batch_size}×{batches.seq_len}); "
            "lower data.num_tokens (or set train.max_steps) or use a larger data source") from None


def _heldout_value(feature_map, i: int, heldout: HeldOut, cfg, device) -> float:
    q, k, *v = (t.to(device, torch.float32) for t in (heldout[i] if isinstance(heldout, dict) else heldout(i)))
    return heldout_loss(feature_map, q, k, torch.arange(q.shape[0]), cfg, v[0] if v else None)


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
