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
from dofla.dof.config import BUDGET_POLICY
from dofla.errors import ConfigError, require
from dofla.feature_maps import build_layer_feature_map
from dofla.feature_maps.blocks import feature_dims
from dofla.models import cache_root, convert, get_adapter
from dofla.models.layers import checked_plan_file, plan_layers
from dofla.models.mixed_attention import MixedAttention
from dofla.models.plan import StudentPlan, check_plan, read_plan
from dofla.stages.keys import training_window
from dofla.train import LayerTrainConfig
from dofla.train.grouped import GroupedFeatures


# the attention settings a plan given whole replaces, at their defaults
PLAN_REPLACES = {"name": "linear", "window": 0, "sinks": 0, "gate": "none", "linear_scale": "fixed"}


def given_plan(cfg: RunConfig) -> StudentPlan | None:
    """The plan ``attention.plan`` names (None without one); its file's errors are one sentence each."""
    if cfg.attention.plan is None:
        return None
    try:
        return read_plan(Path(cfg.attention.plan).expanduser())
    except ValueError as error:
        raise ConfigError(f"attention.plan: {error}") from None


def check_given_plan(cfg: RunConfig, config=None, geometry=None) -> None:
    """``attention.plan``'s checks, one sentence each: the settings it replaces left at their defaults, and
    the plan against the teacher's layers and heads (its ``config``, read before any weight loads, or its
    ``geometry`` once loaded)."""
    plan, a = given_plan(cfg), cfg.attention
    if plan is None:
        return
    changed = [f"attention.{k}={getattr(a, k)}" for k, v in PLAN_REPLACES.items() if getattr(a, k) != v]
    require(not changed, f"attention.plan={a.plan} sets every head's form, window, sinks, state, M and gate; drop "
            f"{', '.join(changed)} (or the plan)")
    require(not cfg.allocation.softmax_layers and cfg.feature_map.name != "softmax",
            f"attention.plan={a.plan} says which heads stay exact (window: all); drop allocation.softmax_layers "
            "and feature_map=softmax")
    delta = any(head.state == "delta" for layer in plan.layers for head in layer)
    require(not delta or cfg.loss.name in ("output", "direct"), f"attention.plan={a.plan} has gated-delta heads, "
            f"which have no kernel for loss={cfg.loss.name} to compare; use loss=output or loss=direct")
    try:
        if config is not None:
            checked_plan_file(Path(a.plan).expanduser(), config)
        if geometry is not None:
            check_plan(plan, geometry)
    except ValueError as error:
        raise ConfigError(f"attention.plan={a.plan}: {error}") from None


def check_budget_run(cfg: RunConfig) -> None:
    """``allocation=budget``'s checks on the settings its plan replaces, one sentence each (as a plan given
    whole: :func:`check_given_plan`; its own values: :mod:`dofla.dof.checks`)."""
    if cfg.allocation.policy != BUDGET_POLICY:
        return
    a = cfg.attention
    changed = [f"attention.{k}={getattr(a, k)}" for k, v in PLAN_REPLACES.items() if getattr(a, k) != v]
    require(not changed, f"allocation=budget chooses every head's form, window, sinks, state and M; drop "
            f"{', '.join(changed)}")
    require(not cfg.allocation.softmax_layers and cfg.feature_map.name != "softmax",
            "allocation=budget chooses which heads stay exact; drop allocation.softmax_layers and feature_map=softmax")


def allocated_plan_path(out_dir: Path) -> Path:
    """Where the allocate stage writes the plan ``allocation=budget`` chose (read as ``attention.plan``)."""
    return out_dir / "plan.json"


def plan_dims(cfg: RunConfig, geometry) -> list | None:
    """The feature dims a plan given whole holds (what the allocate stage gives otherwise); None without one."""
    plan = given_plan(cfg)
    return None if plan is None else plan.dims(geometry.num_heads // geometry.num_kv_heads)

logger = logging.getLogger(__name__)


def linear_layers(cfg: RunConfig, geometry) -> list[int]:
    """Layers that get feature maps: a plan's layers with a head that keeps a linear state; none for
    training-free sliding-window attention; otherwise every layer the teacher itself does not already
    restrict to a sliding window."""
    plan = given_plan(cfg)
    if plan is not None:
        return [i for i, layer in enumerate(plan.layers) if any(head.state != "none" for head in layer)]
    if not get_form(cfg.attention.name).traits.trains:
        return []
    windows = geometry.layer_windows or (None,) * geometry.num_layers
    return [i for i, w in enumerate(windows) if w is None]


def build_feature_maps(cfg: RunConfig, geometry, dims: list) -> list:
    """One fresh feature map per layer (seeded by layer); None for a layer without features (dim 0).
    A gated-delta layer's is its feature map with its gates (they train and are saved together). Under a
    plan given whole, each layer's trained part as the student builds it (:func:`layer_features`: a mixed
    layer's groups together)."""
    plan = given_plan(cfg)
    if plan is not None:
        chunk = 128 if cfg.attention.chunk_size == "auto" else cfg.attention.chunk_size  # features do not chunk
        layers = plan_layers(plan, geometry, cfg.feature_map.name, dict(cfg.feature_map.options), cfg.seed, chunk)
        return [layer_features(attn, grouped=True) for attn in layers]
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


def layer_features(attn, grouped: bool = False):
    """What the layerwise stage trains and a layer artifact holds of a student attention: its feature map
    (None without one); a mixed layer's groups with features together, and with ``grouped`` (a plan given
    whole, whose layers each train with their own window and sinks) any layer's, as a
    :class:`GroupedFeatures` holding the student's own modules, so loading its state loads them."""
    if isinstance(attn, MixedAttention):
        parts = [(part.feature_map, q, kv, part.window, part.sinks) for part, q, kv in attn.trainable_parts()]
        return GroupedFeatures(parts) if parts else None
    if grouped and attn.feature_map is not None:
        heads, kv_heads = list(range(attn.num_heads)), list(range(attn.num_kv_heads))
        return GroupedFeatures([(attn.feature_map, heads, kv_heads, attn.window, attn.sinks)])
    return attn.feature_map


def per_layer_meta(meta: dict, i: int, attn) -> dict:
    """Layer ``i``'s artifact meta: the run's layer meta, the layer and its feature dims (a plan's layer
    meta names its plan: :func:`dofla.stages.keys.layer_meta`)."""
    return {**meta, "layer": i, "num_features": feature_dims(layer_features(attn, "plan" in meta))}


def trainable(attn) -> bool:
    """Whether a student attention has features with parameters to train."""
    features = layer_features(attn)
    return features is not None and any(p.requires_grad for p in features.parameters())


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
    common = dict(feature_map=cfg.feature_map.name, feature_map_options=dict(cfg.feature_map.options),
                  chunk_size=chunk_size(cfg, teacher, dims), seed=cfg.seed)
    plan = given_plan(cfg)
    if plan is not None:  # the plan's heads replace the attention settings and dims (check_given_plan)
        layers = get_adapter(teacher).geometry(teacher.config).num_layers  # a model cut to its first layers too
        return convert(copy.deepcopy(teacher), plan=StudentPlan(plan.layers[:layers]), **common)
    return convert(copy.deepcopy(teacher), dims=dims, window=cfg.attention.window, attention=cfg.attention.name,
                   sinks=cfg.attention.sinks, gate=cfg.attention.gate, linear_scale=cfg.attention.linear_scale,
                   **common)


def plan_memory(student, contexts: list[int]) -> dict:
    """``memory/student/plan_mib/T<context>``: the MiB of one sequence's decode cache that the student's saved
    plan predicts (:meth:`dofla.models.plan.StudentPlan.state_bytes`), beside the eval stage's measured
    ``memory/student/decode_mib/T<context>``."""
    geometry = get_adapter(student).geometry(student.config)
    plan, kv_bytes = StudentPlan.from_list(student.config.dofla["plan"]), next(student.parameters()).element_size()
    group = geometry.num_heads // geometry.num_kv_heads
    return {f"memory/student/plan_mib/T{c}": plan.state_bytes(group, geometry.head_dim, c, kv_bytes) / 2**20
            for c in contexts}


def with_settings(model, settings: dict):
    """Attach the settings a model was built from (the eval stage keys its measurements by them)."""
    model.dofla_settings = settings
    return model
