"""The train stage: which layers get trained features, where their artifacts live, and how they are
trained: layerwise from the activation cache, layerwise from a stream of fresh teacher activations
(``train.source=stream``), or the whole student end to end (``loss=direct``)."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dofla import distributed
from dofla.artifacts import settings_digest
from dofla.config import RunConfig
from dofla.feature_maps.blocks import feature_dims
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.data import stream_steps, training_stream
from dofla.stages.keys import layer_meta, layer_settings, training_window
from dofla.train.losses import end_to_end


@dataclass
class TrainResult:
    """Per-layer training summaries (layerwise), or ``direct``: ``direct_done.json`` (end to end)."""

    summaries: dict[int, dict] = field(default_factory=dict)
    direct: dict | None = None

    def tokens(self) -> int | None:
        """Distillation tokens the features saw when they were counted while training (streamed or
        direct); None when they are the cached tokens."""
        if self.direct is not None:
            return self.direct.get("tokens")
        streamed = [s["tokens"] for s in self.summaries.values() if "tokens" in s]
        return max(streamed) if streamed else None


def run(ctx: RunContext, cache, dims: list, data: RunData, tracker=None) -> TrainResult:
    """Train the features of every layer that has them (or the ``train.layers`` subset); ``tracker``
    gets the live curves (every ``train.log_every`` steps)."""
    out = train(ctx.cfg, cache, ctx.geometry, dims, ctx.teacher, data.train_tokens, ctx.out_dir, ctx.tokenizer,
                ctx.source, capture=ctx.capture, data_source=ctx.data_source,
                on_log=None if tracker is None else tracker.log)
    if end_to_end(ctx.cfg.loss.name):
        return TrainResult(direct=out)
    return TrainResult(summaries=out)


def linear_layers(cfg: RunConfig, geometry) -> list[int]:
    """Layers that get feature maps: none for training-free sliding-window attention; otherwise
    every layer the teacher itself does not already restrict to a sliding window."""
    if cfg.attention.name == "sliding_window":
        return []
    windows = geometry.layer_windows or (None,) * geometry.num_layers
    return [i for i, w in enumerate(windows) if w is None]


def build_feature_maps(cfg: RunConfig, geometry, dims: list) -> list:
    """One fresh feature map per layer (seeded by layer); None for a layer without features (dim 0)."""
    from dofla.feature_maps import build_layer_feature_map

    return [
        None if m == 0 else build_layer_feature_map(cfg.feature_map.name, geometry.num_heads, geometry.head_dim,
                                                    m, seed=cfg.seed + i, **cfg.feature_map.options)
        for i, m in enumerate(dims)
    ]


def layer_train_config(cfg: RunConfig):
    """The trainers' config: the run's optimisation settings and what the loss needs."""
    from dofla.config import StepConfig
    from dofla.train import LayerTrainConfig

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


def train(cfg: RunConfig, cache, geometry, dims, teacher, train_tokens, out_dir: Path,
                tokenizer=None, source: str = "cache", capture=None, data_source=None, on_log=None) -> dict:
    """Layerwise (l2 / softmax; from the cache or streamed) or end-to-end (direct) feature training
    of the layers that have feature maps (:func:`linear_layers`). ``capture``: the teacher whose
    forwards a stream reads (``train.teacher_dtype``; default ``teacher``); ``data_source``: the opened
    data a stream reads (default: opened from ``cfg``); ``on_log``: the live curves' callback."""
    requested = range(len(dims)) if cfg.train.layers is None else cfg.train.layers
    layers = [i for i in requested if i in set(linear_layers(cfg, geometry))]
    meta, settings = layer_meta(cfg, cache.key), layer_settings(cfg, cache.key, dims)
    directory, *also_read = layer_dirs(cfg, out_dir, settings)
    if distributed.is_main():  # tells a human what the hash directory's name stands for
        write_json(directory / "settings.json", settings)
    if end_to_end(cfg.loss.name):
        stream = (lambda: training_stream(cfg, tokenizer, cfg.train.direct_batch_size, train_tokens.numel(),
                                          source=data_source)) \
            if source == "stream" else None
        return _train_direct(cfg, dims, teacher, train_tokens, directory, meta, settings, stream, on_log)
    if not layers:
        return {}
    device = next(teacher.parameters()).device  # layers train where the teacher runs
    feature_maps = [None if fm is None else fm.to(device) for fm in build_feature_maps(cfg, geometry, dims)]
    train_cfg = replace(layer_train_config(cfg), softcap=geometry.softcap)
    if source == "stream":
        return _train_streaming(cfg, cache, capture or teacher, tokenizer, feature_maps, layers, train_cfg,
                                directory, meta, data_source, on_log)
    from dofla.train import run_layerwise
    from dofla.train.layerwise import needs_values

    values = needs_values(train_cfg.loss)  # only the output loss reads v

    def activations(i: int):
        return cache.layer(i).torch(values=values)

    if distributed.world() == 1:
        return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read, on_log)
    # torchrun: layer i on rank i mod N, then every rank reads all the artifacts
    run_layerwise(feature_maps, activations, distributed.mine(layers), train_cfg, directory, meta, also_read,
                  on_log)
    distributed.barrier()
    return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read)


def _train_streaming(cfg, cache, teacher, tokenizer, feature_maps, layers, train_cfg, directory, meta,
                     data_source=None, on_log=None) -> dict:
    """One pass over ``data.num_tokens`` fresh tokens (the cached sample is skipped and held out)."""
    from dofla.train.stream import run_streaming
    from dofla.train.teacher_acts import cache_heldout

    cached_seqs = cache.layer(0).q.shape[0]
    batches = training_stream(cfg, tokenizer, cfg.train.batch_size, cached_seqs * cfg.data.seq_len,
                              source=data_source)
    held = max(1, round(cfg.train.heldout_fraction * cached_seqs))
    heldout = cache_heldout(cache, num_seqs=held)
    kwargs = dict(num_tokens=cfg.data.num_tokens, steps=stream_steps(cfg, batches.batch_tokens), on_log=on_log)
    split_batches = distributed.splits_batches(cfg.train.parallel, "stream")
    if distributed.world() > 1 and not split_batches:  # layer i on rank i mod N, then every rank reads them all
        run_streaming(teacher, batches, feature_maps, distributed.mine(layers), train_cfg, heldout, directory,
                      meta, **kwargs)
        distributed.barrier()
    return run_streaming(teacher, batches, feature_maps, layers, train_cfg, heldout, directory, meta,
                         data_parallel=split_batches, **kwargs)


def per_layer_meta(meta: dict, i: int, attn) -> dict:
    return {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}


def trainable(attn) -> bool:
    return attn.feature_map is not None and any(p.requires_grad for p in attn.feature_map.parameters())


def _train_direct(cfg, dims, teacher, train_tokens, directory: Path, meta: dict, settings: dict,
                  stream=None, on_log=None) -> dict:
    """End-to-end training, skipped when ``direct_done.json`` has our settings and every layer verifies.

    Trains on ``train_tokens`` (S, L) (``train.steps`` steps of random rows), or, when ``stream``
    (a callable making a ``BatchStream``) is given, one pass over ``data.num_tokens`` of it.
    ``direct_done.json`` records the tokens trained on."""
    from dofla.artifacts import artifact_problem, save_artifact
    from dofla.train import train_direct

    done = directory / "direct_done.json"
    student = make_student(cfg, teacher, dims)
    marker = read_json(done)
    if marker is not None and marker.get("settings") == settings and not any(
            artifact_problem(directory / f"layer_{i:02d}.pt", per_layer_meta(meta, i, attn))
            for i, attn in enumerate(student.student_attentions()) if trainable(attn)):
        return marker
    dcfg = replace(layer_train_config(cfg), batch_size=cfg.train.direct_batch_size)
    data = train_tokens if stream is None else stream()
    if stream is not None:
        dcfg = replace(dcfg, steps=stream_steps(cfg, data.batch_tokens))
    curve = train_direct(student, data, dcfg, checkpoint_path=directory / "direct_ckpt.pt", meta=settings,
                         on_log=on_log)
    tokens = train_tokens.numel() if stream is None else len(curve) * data.batch_tokens
    if distributed.is_main():  # under torchrun every rank holds the same features
        for i, attn in enumerate(student.student_attentions()):
            if attn.feature_map is None:  # a teacher sliding-window layer: kept exact, nothing trained
                continue
            save_artifact(directory / f"layer_{i:02d}.pt", {"state_dict": attn.feature_map.state_dict(),
                                                             "curve": curve}, per_layer_meta(meta, i, attn))
        write_json(done, {"settings": settings, "steps": len(curve), "tokens": tokens, "curve": curve})
    distributed.barrier()
    return read_json(done)


def chunk_size(cfg: RunConfig, teacher, dims) -> int:
    """``attention.chunk_size``, with ``auto`` resolved to the fastest on this machine for the student's
    shape (its heads, its median feature count, the head dim), measured once (dofla.attention.tuning)."""
    if cfg.attention.chunk_size != "auto":
        return cfg.attention.chunk_size
    import statistics

    from dofla.attention.tuning import FILE, best_chunk_size
    from dofla.models import cache_root, get_adapter

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
    print(line, flush=True)


def make_student(cfg: RunConfig, teacher, dims):
    from dofla.models import convert

    return convert(copy.deepcopy(teacher), feature_map=cfg.feature_map.name, dims=dims,
                   feature_map_options=dict(cfg.feature_map.options),
                   chunk_size=chunk_size(cfg, teacher, dims), seed=cfg.seed,
                   window=cfg.attention.window, attention=cfg.attention.name, sinks=cfg.attention.sinks,
                   gate=cfg.attention.gate, linear_scale=cfg.attention.linear_scale)
