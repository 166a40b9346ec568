"""Train one layer's feature map on its own, from cached teacher queries and keys.

No teacher forward pass: the loss compares the teacher's attention kernel on cached q, k with the
student's. Adam with the paper's learning rates (z 0.02, α 0.2), warm-up, early stopping on
held-out sequences of the cache, checkpoints every few steps so a killed run resumes exactly (the
loop, its checkpoints and its best state are :mod:`dofla.train.loop`'s).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from dofla.artifacts import load_artifact, save_artifact
from dofla.attention.delta_gates import DeltaFeatureMap
from dofla.attention.stable import widened
from dofla.train.config import NOT_LEARNT, StepConfig
from dofla.train.grouped import GroupedFeatures
from dofla.feature_maps.blocks import blocks, feature_dims
from dofla.precision import autocast
from dofla.train.causal_losses import teacher_output
from dofla.train.live import Log
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, cpu_state, run_loop  # noqa: F401
from dofla.train.losses import LOSSES, compiled_loss


@dataclass
class LayerTrainConfig(StepConfig):
    """A trainer's config: the optimisation (:class:`dofla.train.config.StepConfig`) plus what the loss needs."""

    loss: str = "softmax"
    loss_options: dict = field(default_factory=dict)
    seed: int = 0
    window: int = 0
    sinks: int = 0  # hybrid: the first `sinks` keys are exact too
    softcap: float | None = None  # the teacher's logit soft-cap (Gemma 2): distil against the capped kernel
    precision: str = "fp32"  # fp32 | tf32 | bf16 (autocast; dofla.precision)
    compile: bool = False  # torch.compile the loss (dofla.train.losses.compiled_loss)


# Trainer fields added after stream checkpoints were first written, at the value that reproduces
# what those did: left out of a checkpoint's settings, so a checkpoint written before a field
# existed still resumes under the newer code (a field added here needs an entry, or NOT_LEARNT:
# tests/component/test_stream.py checks that every field is declared)
CHECKPOINT_LEGACY = {"sinks": 0, "softcap": None, "precision": "fp32"}


def learnt(train: dict) -> dict:
    """A trainer config's fields (``asdict``) that change what is learnt, those at their legacy value
    left out: what a stream checkpoint records of its trainer."""
    return {k: v for k, v in train.items() if k not in NOT_LEARNT and CHECKPOINT_LEGACY.get(k, object()) != v}


def comparable_meta(meta):
    """A stream checkpoint's meta as compared on resume: its trainer part through :func:`learnt`, so
    checkpoints that recorded a later field at its legacy value (or a step-only one) resume too."""
    return {**meta, "train": learnt(meta.get("train") or {})} if isinstance(meta, dict) else meta


@dataclass
class LayerTrainResult:
    state_dict: dict
    curve: list[dict]
    best_step: int
    initial_heldout_loss: float
    final_heldout_loss: float
    steps_run: int
    seconds: float


def param_groups(feature_map, cfg: LayerTrainConfig) -> list[dict]:
    """Adam groups: z at lr_z, α at lr_alpha (the paper's), anything else at lr_other."""
    named = getattr(feature_map, "param_groups", None)
    if named is not None:
        lrs = {"z": cfg.lr_z, "alpha": cfg.lr_alpha}
        return [{"params": g["params"], "lr": lrs.get(g["name"], cfg.lr_other)} for g in named()]
    params = [p for p in feature_map.parameters() if p.requires_grad]
    return [{"params": params, "lr": cfg.lr_other}] if params else []


def split_sequences(num_seqs: int, heldout_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, held-out indices) of the cache's sequences (at least one of each if possible)."""
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(seed))
    held = min(num_seqs - 1, max(1, round(heldout_fraction * num_seqs))) if heldout_fraction > 0 else 0
    return order[held:], order[:held] if held else order[:1]


def needs_values(loss: str) -> bool:
    """Whether the layerwise loss ``loss`` reads the teacher's values v (``output``)."""
    return getattr(LOSSES.get(loss), "needs_values", False)


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's parameters (or, without any, its buffers) live; the CPU for neither."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def layer_loss(feature_map, q: torch.Tensor, k: torch.Tensor, cfg: LayerTrainConfig,
               v: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, L, d), k and v (B, H_kv, L, d) -> the configured loss (GQA keys and values
    expanded per group; v is read only by a loss that needs values). The activations move to the
    feature map's device (they come from a host-memory cache)."""
    if isinstance(feature_map, GroupedFeatures):
        return grouped_loss(feature_map, q, k, cfg, v)
    device = module_device(feature_map)
    q, k = q.to(device), k.to(device)
    v = None if v is None else v.to(device)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    loss_fn = compiled_loss(cfg.loss) if cfg.compile else LOSSES.get(cfg.loss)
    values = needs_values(cfg.loss)
    if values:
        if v is None:
            raise ValueError(f"loss {cfg.loss!r} compares attention outputs; pass the teacher's values v")
        v = v.repeat_interleave(group, dim=1)
    with autocast(cfg.precision, device):
        return _block_losses(feature_map, q, k, v, cfg, loss_fn, values)


def grouped_loss(grouped: GroupedFeatures, q, k, cfg: LayerTrainConfig, v=None) -> torch.Tensor:
    """A mixed layer's loss: each group's :func:`layer_loss` on its heads' q, k (and v) with its own window and
    sinks, weighted by its share of the trained query heads (so a group's loss means what a layer's does)."""
    total = 0.0
    for fm, (heads, kv, window, sinks) in zip(grouped.parts, grouped.slices):
        part_cfg = replace(cfg, window=window, sinks=sinks)
        loss = layer_loss(fm, q[:, heads], k[:, kv], part_cfg, None if v is None else v[:, kv])
        total = total + loss * (len(heads) / grouped.num_heads)
    return total


def _block_losses(feature_map, q, k, v, cfg: LayerTrainConfig, loss_fn, values: bool) -> torch.Tensor:
    total = 0.0
    for block, heads in blocks(feature_map):  # per-head dims: the heads-weighted mean over blocks
        qb, kb = (q, k) if heads is None else (q[:, heads], k[:, heads])
        extra = {"sinks": cfg.sinks} if cfg.sinks else {}
        if cfg.softcap is not None:
            extra["softcap"] = cfg.softcap
        if values:
            extra["v"] = v if heads is None else v[:, heads]
        if isinstance(block, DeltaFeatureMap):  # a gated-delta layer: the output loss runs its own attention
            extra["student"] = block
            if not block.calibrated:  # its output gain starts from the first batch (DeltaFeatureMap.calibrate_)
                block.calibrate_(qb, kb, extra["v"], teacher_output(qb, kb, extra["v"], cfg.softcap), window=cfg.window,
                                 sinks=cfg.sinks, softcap=cfg.softcap)
        loss = loss_fn(widened(block.log_features(qb)), widened(block.log_features(kb)), qb, kb, window=cfg.window,
                       **extra, **cfg.loss_options)
        total = total + loss * (qb.shape[1] / q.shape[1])
    return total


@torch.no_grad()
def heldout_loss(feature_map, q, k, index: torch.Tensor, cfg: LayerTrainConfig, v=None) -> float:
    losses = [layer_loss(feature_map, q[b], k[b], cfg, None if v is None else v[b]).item() * len(b)
              for b in index.split(cfg.batch_size)]
    return sum(losses) / len(index)


def mean_over_rows(loss: str) -> bool:
    """Whether the layerwise loss ``loss`` is a mean over the batch's rows, so micro-batches add up to it."""
    return getattr(LOSSES.get(loss), "mean_over_rows", True)


class CachedLayer(Trainer):
    """One layer's features on its cached q, k (and v): random training sequences each step (their
    draw is the data position), the held-out sequences for the best state and patience."""

    def __init__(self, feature_map, q, k, v, cfg: LayerTrainConfig, desc: str, layer: int):
        self.q, self.k, self.v, self.cfg, self.desc = q, k, v, cfg, desc
        self.train_idx, self.held_idx = split_sequences(q.shape[0], cfg.heldout_fraction, cfg.seed)
        groups = param_groups(feature_map, cfg)
        optimizer = torch.optim.Adam(groups, betas=(0.9, 0.999), weight_decay=0.0) if groups else None
        self.units = {layer: Unit(feature_map, optimizer)}
        self.generator = torch.Generator().manual_seed(cfg.seed + 1)
        self.batch_tokens, self.kill = cfg.batch_size * q.shape[2], f"train:{desc}:step"
        self.device = module_device(feature_map)

    def next_batch(self, step: int) -> torch.Tensor:
        return self.train_idx[torch.randint(len(self.train_idx), (self.cfg.batch_size,), generator=self.generator)]

    def loss(self, key, rows: torch.Tensor) -> torch.Tensor:
        return layer_loss(self.units[key].module, self.q[rows], self.k[rows], self.cfg,
                          None if self.v is None else self.v[rows])

    def heldout(self, key) -> float:
        return heldout_loss(self.units[key].module, self.q, self.k, self.held_idx, self.cfg, self.v)

    def data_state(self):
        return self.generator.get_state()

    def restore_data(self, state) -> None:
        self.generator.set_state(state)

    def message(self, key, step: int) -> str:
        return f"{self.desc}: non-finite training loss at step {step}"


def train_layer(feature_map, q: torch.Tensor, k: torch.Tensor, cfg: LayerTrainConfig,
                checkpoint_path: Path | None = None, desc: str = "layer",
                meta: dict | None = None, v: torch.Tensor | None = None, layer: int = 0,
                on_log: Log | None = None) -> LayerTrainResult:
    """Train ``feature_map`` (the features of layer ``layer``) on q (S, H, L, d), k (S, H_kv, L, d)
    (and values v (S, H_kv, L, d) for a loss that needs them); returns the best-held-out state.

    The checkpoint records ``meta`` (the settings); one written with other settings is ignored.
    ``on_log`` gets the latest losses every ``cfg.log_every`` steps (:mod:`dofla.train.live`).
    The loop is :func:`dofla.train.loop.run_loop`'s.
    """
    start_time = time.perf_counter()
    trainer = CachedLayer(feature_map, q, k, v, cfg, desc, layer)
    done = run_loop(trainer, LoopConfig.of(cfg), Checkpointing(checkpoint_path, meta), on_log, desc=desc)
    record = done.records[layer]
    return LayerTrainResult(state_dict=record["best_state"], curve=record["curve"], best_step=record["best_step"],
                            initial_heldout_loss=record["initial"], final_heldout_loss=record["best"],
                            steps_run=done.step, seconds=time.perf_counter() - start_time)


def run_layerwise(feature_maps: list, activations: Callable[[int], tuple[torch.Tensor, ...]],
                  layers: list[int], cfg: LayerTrainConfig, out_dir: Path, meta: dict | None = None,
                  also_read: Sequence[Path] = (), on_log: Log | None = None) -> dict[int, dict]:
    """Train each requested layer independently; one verified artifact ``layer_XX.pt`` per layer.

    ``activations(i)`` gives layer i's (q, k) or (q, k, v); values are needed by the ``output`` loss.
    Layers whose artifact exists and verifies (same ``meta``) in ``out_dir``, or else in one of
    ``also_read`` (directories of other runs, only read), are loaded, not retrained (resume, or
    per-layer parallel jobs sharing ``out_dir``). Only ``out_dir`` is written.
    """
    out_dir = Path(out_dir)
    summaries = {}
    for i in tqdm(layers, desc=f"train ({cfg.loss})", unit="layer"):
        artifact = out_dir / f"layer_{i:02d}.pt"
        layer_meta = {**(meta or {}), "layer": i, "num_features": feature_dims(feature_maps[i])}
        existing = find_artifact([out_dir, *also_read], artifact.name, layer_meta)
        if existing is not None:
            feature_maps[i].load_state_dict(existing["state_dict"])
            summaries[i] = existing["summary"]
            continue
        q, k, *v = activations(i)
        ckpt = out_dir / f"layer_{i:02d}.ckpt"
        result = train_layer(feature_maps[i], q, k, cfg, ckpt, desc=f"layer{i}", meta=layer_meta,
                             v=v[0] if v else None, layer=i, on_log=on_log)
        summary = {"layer": i, "initial_heldout_loss": result.initial_heldout_loss,
                   "final_heldout_loss": result.final_heldout_loss, "best_step": result.best_step,
                   "steps_run": result.steps_run, "seconds": result.seconds, "curve": result.curve}
        save_artifact(artifact, {"state_dict": result.state_dict, "curve": result.curve, "summary": summary},
                      layer_meta)
        ckpt.unlink(missing_ok=True)  # ours: written with layer_meta just above, in our own directory
        summaries[i] = summary
    return summaries


def find_artifact(directories: Sequence[Path], name: str, meta: dict) -> dict | None:
    """The first verifying artifact ``name`` in ``directories`` (the first one is ours; the others
    are only read, so a file there that does not verify is passed over in silence)."""
    for n, directory in enumerate(directories):
        found = load_artifact(Path(directory) / name, meta, quiet=n > 0)
        if found is not None:
            return found
    return None
