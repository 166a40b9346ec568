"""The student as the stages build it, shared by the train, allocate, assemble and preflight stages (a
module of helpers, not a stage): which layers get features, fresh feature maps, the trainers'
config, where layer artifacts live, and the converted student itself."""
from __future__ import annotations

import copy
import functools
import logging
import statistics
from dataclasses import fields
from pathlib import Path

from dofla.artifacts import settings_digest
from dofla.attention.forms import get_form
from dofla.attention.tuning import FILE, best_chunk_size
from dofla.config import RunConfig, StepConfig
from dofla.feature_maps import build_layer_feature_map
from dofla.feature_maps.blocks import feature_dims
from dofla.models import cache_root, convert, get_adapter
from dofla.stages.keys import training_window
from dofla.train import LayerTrainConfig

logger = logging.getLogger(__name__)


def linear_layers(cfg: RunConfig, geometry) -> list[int]:
    """Layers that get feature maps: none for training-free sliding-window attention; otherwise
    every layer the teacher itself does not already restrict to a sliding window."""
    if not get_form(cfg.attention.name).traits.trains:
        return []
    windows = geometry.layer_windows or (None,) * geometry.num_layers
    return [i for i, w in enumerate(windows) if w is None]


def build_feature_maps(cfg: RunConfig, geometry, dims: list) -> list:
    """One fresh feature map per layer (seeded by layer); None for a layer without features (dim 0).
    A gated-delta layer's is its feature map with its gates (they train and are saved together)."""
    maps = [
        None if m == 0 else build_layer_feature_map(cfg.feature_map.name, geometry.num_heads, geometry.head_dim,
                                                    m, seed=cfg.seed + i, **cfg.feature_map.options)
        for i, m in enumerate(dims)
    ]
    form = get_form(cfg.attention.name)
    return [None if fm is None else form.trained_part(fm) for fm in maps]


def layer_train_config(cfg: RunConfig):
    """The trainers' config: the run's optimisation settings and what the loss needs."""
    steps = {f.name: getattr(cfg.train, f.name) for f in fields(StepConfig)}
    window, sinks = training_window(cfg)
    return LayerTrainConfig(**steps, loss=cfg.loss.name, loss_options=dict(cfg.loss.options), seed=cfg.seed,
                            window=window, sinks=sinks, precision=cfg.precision, compile=cfg.train.compile)


def layer_dir(cfg: RunConfig, out_dir: Path) -> Path:
    """Where layer artifacts live: the run's ``layers/``, or a directory shared by parallel jobs."""
    return Path(cfg.train.layer_dir).expanduser() if cfg.train.layer_dir else out_dir / "layers"


def settings_dir(cfg: RunConfig, out_dir: Path, settings: dict) -> Path:
    """Where this run writes layer artifacts, checkpoints and ``direct_done.json``: the run's own
    ``layers/``, or ``<train.layer_dir>/<hash12 of settings>/`` so that jobs of other settings
    sharing ``train.layer_dir`` never touch each other's files."""
    if not cfg.train.layer_dir:
        return out_dir / "layers"
    return layer_dir(cfg, out_dir) / settings_digest(settings)


def layer_dirs(cfg: RunConfig, out_dir: Path, settings: dict) -> list[Path]:
    """Directories a layer is looked up in: ours first, then (read only) a shared ``train.layer_dir``
    itself, which may hold a run's own flat ``layers/`` of the same settings."""
    own, base = settings_dir(cfg, out_dir, settings), layer_dir(cfg, out_dir)
    return [own] if own == base else [own, base]


def per_layer_meta(meta: dict, i: int, attn) -> dict:
    """Layer ``i``'s artifact meta: the run's layer meta, the layer and its feature dims."""
    return {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}


def trainable(attn) -> bool:
    """Whether a student attention has features with parameters to train."""
    return attn.feature_map is not None and any(p.requires_grad for p in attn.feature_map.parameters())


def chunk_size(cfg: RunConfig, teacher, dims) -> int:
    """``attention.chunk_size``, with ``auto`` resolved to the fastest on this machine for the student's
    shape (its heads, its median feature count, the head dim), measured once (dofla.attention.tuning)."""
    if cfg.attention.chunk_size != "auto":
        return cfg.attention.chunk_size
    g = get_adapter(teacher).geometry(teacher.config)
    flat = [m for d in dims for m in (d if isinstance(d, (list, tuple)) else [d])]
    features = int(statistics.median(flat)) if flat else g.head_dim
    device = next(teacher.parameters()).device
    best = best_chunk_size(g.num_heads, features, g.head_dim, device, cache_root())
    _say_once(f"dofla: attention.chunk_size=auto is {best} here (heads {g.num_heads}, M {features}; measured once, "
              f"kept in {cache_root() / FILE})")
    return best


@functools.cache
def _say_once(line: str) -> None:
    logger.info(line)


def make_student(cfg: RunConfig, teacher, dims):
    """A fresh student: a copy of ``teacher`` with ``dims`` features per layer, the run's attention form."""
    return convert(copy.deepcopy(teacher), feature_map=cfg.feature_map.name, dims=dims,
                   feature_map_options=dict(cfg.feature_map.options),
                   chunk_size=chunk_size(cfg, teacher, dims), seed=cfg.seed,
                   window=cfg.attention.window, attention=cfg.attention.name, sinks=cfg.attention.sinks,
                   gate=cfg.attention.gate, linear_scale=cfg.attention.linear_scale)


def with_settings(model, settings: dict):
    """Attach the settings a model was built from (the eval stage keys its measurements by them)."""
    model.dofla_settings = settings
    return model
