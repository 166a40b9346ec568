"""The train stage: which layers get trained features, where their artifacts live, and how they
are trained: layerwise from the activation cache, layerwise from a stream of fresh teacher
activations (``train.source=stream``), or end to end (``loss=direct``)."""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import torch

from dofla import distributed
from dofla.artifacts import canonical, settings_digest
from dofla.config import RunConfig
from dofla.feature_maps.blocks import feature_dims
from dofla.record import read_json, write_json

# bumped when a feature map's parameters change meaning (2: Hedgehog as published, with a bias),
# so layer artifacts of the old layout are retrained instead of failing to load
ARTIFACT_FORMAT = 2
STREAM_CACHE_TOKENS = 8192  # data.cache_tokens default when training streams


def linear_layers(cfg: RunConfig, geometry) -> list[int]:
    """Layers that get feature maps: none for training-free sliding-window attention; otherwise
    every layer the teacher itself does not already restrict to a sliding window."""
    if cfg.attention.name == "sliding_window":
        return []
    windows = geometry.layer_windows or (None,) * geometry.num_layers
    return [i for i, w in enumerate(windows) if w is None]


def train_source(cfg: RunConfig, predicted_cache_bytes: int) -> str:
    """``cache`` or ``stream``: ``train.source``, or for ``auto`` stream when caching every
    distillation token would exceed ``train.cache_limit_gb``."""
    if cfg.train.source != "auto":
        return cfg.train.source
    return "stream" if predicted_cache_bytes > cfg.train.cache_limit_gb * 2**30 else "cache"


def cached_tokens(cfg: RunConfig, source: str) -> int:
    """Distillation tokens whose activations go to the cache: all of them for the cache path, a
    bounded sample (``data.cache_tokens``, default 8,192) when training streams."""
    if source != "stream":
        return cfg.data.num_tokens
    return min(cfg.data.num_tokens, cfg.data.cache_tokens or STREAM_CACHE_TOKENS)


@torch.no_grad()
def teacher_tokens_per_second(teacher, seq_len: int) -> float:
    """One timed teacher forward of a (1, seq_len) batch: the throughput the predictions use."""
    import time

    device = next(teacher.parameters()).device
    ids = torch.randint(0, teacher.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    teacher(input_ids=ids.to(device), use_cache=False)
    return seq_len / max(time.perf_counter() - start, 1e-9)


def choose_train_source(cfg: RunConfig, plan: list[str], geometry, teacher) -> str:
    """``cache``, ``stream`` or ``none`` (nothing to train); prints the choice with the predicted
    disk use and teacher time before any teacher pass."""
    from dofla.cache import predict_cache_bytes

    if "train" not in plan:
        return "none"
    L = cfg.data.seq_len
    full = predict_cache_bytes(geometry, cfg.data.num_tokens // L, L)
    source = train_source(cfg, full)
    kept = predict_cache_bytes(geometry, cached_tokens(cfg, source) // L, L)
    rate = teacher_tokens_per_second(teacher, L)
    why = {"auto": f"train.source=auto, limit {cfg.train.cache_limit_gb:g} GB"}.get(cfg.train.source,
                                                                                   f"train.source={source}")
    what = ("a stream of fresh token batches (end to end)" if cfg.loss.name == "direct" and source == "stream" else
            f"{'a stream of fresh' if source == 'stream' else 'cached'} teacher activations")
    print(f"dofla: training reads {what} "
          f"({why}); caching all {cfg.data.num_tokens:,} tokens would take {full / 2**30:.2f} GB, this run caches "
          f"{cached_tokens(cfg, source):,} tokens ({kept / 2**30:.2f} GB); the teacher runs at ≈ {rate:,.0f} tokens/s "
          f"here, so its passes over {cfg.data.num_tokens:,} tokens take ≈ {cfg.data.num_tokens / rate / 60:.1f} min"
          + (" (plus every layer's loss and update per step)" if source == "stream" and cfg.loss.name != "direct"
             else ""), flush=True)
    return source


def build_feature_maps(cfg: RunConfig, geometry, dims: list) -> list:
    """One fresh feature map per layer (seeded by layer); None for a layer without features (dim 0)."""
    from dofla.feature_maps import build_layer_feature_map

    return [
        None if m == 0 else build_layer_feature_map(cfg.feature_map.name, geometry.num_heads, geometry.head_dim,
                                                    m, seed=cfg.seed + i, **cfg.feature_map.options)
        for i, m in enumerate(dims)
    ]


def layer_train_config(cfg: RunConfig):
    from dofla.train import LayerTrainConfig

    t = cfg.train
    return LayerTrainConfig(
        loss=cfg.loss.name, loss_options=dict(cfg.loss.options), steps=t.steps,
        batch_size=t.batch_size, lr_z=t.lr_z, lr_alpha=t.lr_alpha, lr_other=t.lr_other,
        warmup_steps=t.warmup_steps, schedule=t.schedule, heldout_fraction=t.heldout_fraction,
        eval_every=t.eval_every, patience=t.patience, seed=cfg.seed,
        checkpoint_every=t.checkpoint_every, skip_nonfinite=t.skip_nonfinite, window=cfg.attention.window,
        sinks=cfg.attention.sinks if cfg.attention.window > 0 else 0,
    )


def layer_dir(cfg: RunConfig, out_dir: Path) -> Path:
    """Where layer artifacts live: the run's ``layers/``, or a directory shared by parallel jobs."""
    return Path(cfg.train.layer_dir).expanduser() if cfg.train.layer_dir else out_dir / "layers"


def artifact_meta(cfg: RunConfig, cache_key: str) -> dict:
    """Everything that determines a layer's trained features (not which job trained it)."""
    skip = ("layers", "layer_dir", "checkpoint_every", "cache_limit_gb")
    train = {k: v for k, v in asdict(cfg.train).items() if k not in skip}
    if train["teacher_dtype"] == "float32":  # the default: meta as before the key existed
        del train["teacher_dtype"]
    meta = {"feature_map": asdict(cfg.feature_map), "loss": asdict(cfg.loss), "window": cfg.attention.window,
            "train": train, "seed": cfg.seed, "cache_key": cache_key, "format": ARTIFACT_FORMAT}
    if cfg.attention.sinks:
        meta["sinks"] = cfg.attention.sinks
    if train["source"] != "cache":  # a streamed layer also depends on what was streamed
        meta["stream"] = {"data": asdict(cfg.data)}
    return meta


def layer_settings(cfg: RunConfig, cache_key: str, dims: list) -> dict:
    """The settings of a run's trained layers: :func:`artifact_meta` without the per-layer fields,
    plus every layer's dims (two allocations must not share a directory)."""
    return canonical({**artifact_meta(cfg, cache_key), "dims": dims})


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


def train_stage(cfg: RunConfig, cache, geometry, dims, teacher, train_tokens, out_dir: Path,
                tokenizer=None, source: str = "cache", capture=None) -> dict:
    """Layerwise (l2 / softmax; from the cache or streamed) or end-to-end (direct) feature training
    of the layers that have feature maps (:func:`linear_layers`). ``capture``: the teacher whose
    forwards a stream reads (``train.teacher_dtype``; default ``teacher``)."""
    requested = range(len(dims)) if cfg.train.layers is None else cfg.train.layers
    layers = [i for i in requested if i in set(linear_layers(cfg, geometry))]
    meta, settings = artifact_meta(cfg, cache.key), layer_settings(cfg, cache.key, dims)
    directory, *also_read = layer_dirs(cfg, out_dir, settings)
    if distributed.is_main():  # tells a human what the hash directory's name stands for
        write_json(directory / "settings.json", settings)
    if cfg.loss.name == "direct":
        stream = (lambda: training_stream(cfg, tokenizer, cfg.train.direct_batch_size, train_tokens.numel())) \
            if source == "stream" else None
        return _train_direct(cfg, dims, teacher, train_tokens, directory, meta, settings, stream)
    if not layers:
        return {}
    device = next(teacher.parameters()).device  # layers train where the teacher runs
    feature_maps = [None if fm is None else fm.to(device) for fm in build_feature_maps(cfg, geometry, dims)]
    train_cfg = replace(layer_train_config(cfg), softcap=geometry.softcap)
    if source == "stream":
        return _train_streaming(cfg, cache, capture or teacher, tokenizer, feature_maps, layers, train_cfg,
                                directory, meta)
    from dofla.train import run_layerwise
    from dofla.train.layerwise import needs_values

    values = needs_values(train_cfg.loss)  # only the output loss reads v

    def activations(i: int):
        return cache.layer(i).torch(values=values)

    if distributed.world() == 1:
        return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read)
    # torchrun: layer i on rank i mod N, then every rank reads all the artifacts
    run_layerwise(feature_maps, activations, distributed.mine(layers), train_cfg, directory, meta, also_read)
    distributed.barrier()
    return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read)


def training_stream(cfg: RunConfig, tokenizer, batch_size: int, skip_tokens: int):
    """The data source's train text as (batch_size, data.seq_len) batches, after skipping the first
    ``skip_tokens`` (the activation cache's sample, which so stays held out)."""
    from dofla.data.stream import source_stream

    batches = source_stream(cfg.data.name, dict(cfg.data.options), tokenizer, batch_size, cfg.data.seq_len)
    batches.discard(skip_tokens)
    return batches


def stream_steps(cfg: RunConfig, batch_tokens: int) -> int:
    """One pass over ``data.num_tokens`` (at least one step), or ``train.max_steps`` if smaller."""
    steps = cfg.data.num_tokens // batch_tokens
    if cfg.train.max_steps is not None:
        steps = min(steps, cfg.train.max_steps)
    return max(1, steps)


def _train_streaming(cfg, cache, teacher, tokenizer, feature_maps, layers, train_cfg, directory, meta) -> dict:
    """One pass over ``data.num_tokens`` fresh tokens (the cached sample is skipped and held out)."""
    from dofla.train.stream import cache_heldout, run_streaming

    cached_seqs = cache.layer(0).q.shape[0]
    batches = training_stream(cfg, tokenizer, cfg.train.batch_size, cached_seqs * cfg.data.seq_len)
    held = max(1, round(cfg.train.heldout_fraction * cached_seqs))
    heldout = cache_heldout(cache, num_seqs=held)
    kwargs = dict(num_tokens=cfg.data.num_tokens, steps=stream_steps(cfg, batches.batch_tokens))
    if distributed.world() > 1:
        run_streaming(teacher, batches, feature_maps, distributed.mine(layers), train_cfg, heldout, directory,
                      meta, **kwargs)
        distributed.barrier()
    return run_streaming(teacher, batches, feature_maps, layers, train_cfg, heldout, directory, meta, **kwargs)


def _layer_meta(meta: dict, i: int, attn) -> dict:
    return {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}


def _trainable(attn) -> bool:
    return attn.feature_map is not None and any(p.requires_grad for p in attn.feature_map.parameters())


def _train_direct(cfg, dims, teacher, train_tokens, directory: Path, meta: dict, settings: dict,
                  stream=None) -> dict:
    """End-to-end training, skipped when ``direct_done.json`` has our settings and every layer verifies.

    Trains on ``train_tokens`` (S, L) (``train.steps`` steps of random rows), or, when ``stream``
    (a callable making a ``BatchStream``) is given, one pass over ``data.num_tokens`` of it.
    ``direct_done.json`` records the tokens trained on."""
    from dofla.artifacts import artifact_problem, save_artifact
    from dofla.train import train_direct

    from dofla.stages import make_student

    done = directory / "direct_done.json"
    student = make_student(cfg, teacher, dims)
    marker = read_json(done)
    if marker is not None and marker.get("settings") == settings and not any(
            artifact_problem(directory / f"layer_{i:02d}.pt", _layer_meta(meta, i, attn))
            for i, attn in enumerate(student.student_attentions()) if _trainable(attn)):
        return marker
    dcfg = replace(layer_train_config(cfg), batch_size=cfg.train.direct_batch_size)
    data = train_tokens if stream is None else stream()
    if stream is not None:
        dcfg = replace(dcfg, steps=stream_steps(cfg, data.batch_tokens))
    curve = train_direct(student, data, dcfg, checkpoint_path=directory / "direct_ckpt.pt", meta=settings)
    tokens = train_tokens.numel() if stream is None else len(curve) * data.batch_tokens
    if distributed.is_main():  # under torchrun every rank holds the same features
        for i, attn in enumerate(student.student_attentions()):
            if attn.feature_map is None:  # a teacher sliding-window layer: kept exact, nothing trained
                continue
            save_artifact(directory / f"layer_{i:02d}.pt", {"state_dict": attn.feature_map.state_dict(),
                                                             "curve": curve}, _layer_meta(meta, i, attn))
        write_json(done, {"settings": settings, "steps": len(curve), "tokens": tokens, "curve": curve})
    distributed.barrier()
    return read_json(done)


