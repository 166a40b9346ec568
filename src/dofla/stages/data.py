"""The data stage: where training reads activations from (cache or stream), and the token tensors.

The choice is printed before any teacher pass with the predicted disk use and teacher time; the
stream's batches come from :func:`training_stream`, after the cached sample, which so stays held out.
"""
from __future__ import annotations

import copy
import time

import torch

from dofla.config import RunConfig
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import cache_fields

STREAM_CACHE_TOKENS = 8192  # data.cache_tokens default when training streams


def run(ctx: RunContext, source=None) -> RunData:
    """Pack the training tokens the cache needs (all of them, or the stream's cached sample) and the
    held-out tokens; ``source``: the data source already checked before loading (else built here)."""
    from dofla.cache import cache_key

    cfg = ctx.cfg
    num_cached = cached_tokens(cfg, ctx.source)
    train, heldout, fingerprint = load_data(cfg, ctx.tokenizer, source, num_cached)
    return RunData(train, heldout, fingerprint, cache_key(cache_fields(cfg, fingerprint, num_cached)))


def load_data(cfg: RunConfig, tokenizer, source=None, train_tokens: int | None = None):
    """(train tokens (S, L), held-out tokens (S', L), data fingerprint); ``source`` is built when not
    given. ``train_tokens`` (default ``data.num_tokens``): how many training tokens to pack here (a
    streaming run packs only the cached sample; the stream reads the rest as it trains)."""
    from dofla.data import build_source, pack_tokens

    source = source or build_source(cfg.data.name, **cfg.data.options)
    L = cfg.data.seq_len
    train = pack_tokens(source.texts("train"), tokenizer, L, train_tokens or cfg.data.num_tokens,
                        desc="tokenize train", source=cfg.data.name)
    return train, pack_heldout(cfg, tokenizer, source), source.fingerprint()


def pack_heldout(cfg: RunConfig, tokenizer, source):
    """The held-out tokens (S', data.seq_len) every evaluation of this data measures on."""
    from dofla.data import pack_tokens

    return pack_tokens(source.texts("heldout"), tokenizer, cfg.data.seq_len, cfg.data.heldout_tokens,
                       desc="tokenize held-out", source=cfg.data.name, setting="data.heldout_tokens")


def capture_teacher(teacher, dtype: str):
    """The teacher whose forwards produce distillation activations: itself in fp32, else a copy in
    ``dtype`` (the fp32 teacher stays for evaluation and the student)."""
    if dtype == "float32":
        return teacher
    return copy.deepcopy(teacher).to(getattr(torch, dtype))


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
    hours = cfg.data.num_tokens / rate / 3600
    if cfg.device == "auto" and next(teacher.parameters()).device.type == "cpu" and hours > 1:
        print(f"dofla: WARNING: no GPU is visible, so device=auto runs on the CPU, where the teacher passes alone "
              f"are predicted to take {hours:.1f} h; set device=cuda to require a GPU (it then fails at once "
              "instead)", flush=True)
    return source


def training_stream(cfg: RunConfig, tokenizer, batch_size: int, skip_tokens: int, seq_len: int | None = None):
    """The data source's train text as (batch_size, seq_len or data.seq_len) batches, after skipping
    the first ``skip_tokens`` (e.g. the activation cache's sample, which so stays held out)."""
    from dofla.data.stream import source_stream

    batches = source_stream(cfg.data.name, dict(cfg.data.options), tokenizer, batch_size, seq_len or cfg.data.seq_len)
    batches.discard(skip_tokens)
    return batches


def stream_steps(cfg: RunConfig, batch_tokens: int) -> int:
    """One pass over ``data.num_tokens`` (at least one step), or ``train.max_steps`` if smaller."""
    steps = cfg.data.num_tokens // batch_tokens
    if cfg.train.max_steps is not None:
        steps = min(steps, cfg.train.max_steps)
    return max(1, steps)
