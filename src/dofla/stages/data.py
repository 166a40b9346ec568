"""The data stage: where training reads activations from (cache or stream), and the token tensors.

The choice is printed before any teacher pass with the predicted disk use and teacher time; the
stream's batches come from :func:`training_stream`, after the cached sample, which so stays held out.
"""
from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path

import torch

from dofla.config import RunConfig
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import cache_fields
from dofla.train.losses import end_to_end

STREAM_CACHE_TOKENS = 8192  # data.cache_tokens default when training streams


def run(ctx: RunContext) -> RunData:
    """Pack the training tokens the cache needs (all of them, or the stream's cached sample) and the
    held-out tokens, from ``ctx.data_source`` (opened here when the context has none)."""
    from dofla.cache import cache_key

    cfg = ctx.cfg
    source = data_source(ctx)
    if hasattr(source, "check_tokenizer"):  # prepared tokens: made by this model's tokenizer?
        source.check_tokenizer(ctx.tokenizer)
    num_cached = cached_tokens(cfg, ctx.source)
    train, heldout, fingerprint = load_data(cfg, ctx.tokenizer, source, num_cached)
    return RunData(train, heldout, fingerprint, cache_key(cache_fields(cfg, fingerprint, num_cached)))


PREPARE_HINT = "dofla-prepare <this run's overrides>"


def data_source(ctx: RunContext):
    """The run's data: the one opened before loading, else opened now."""
    return ctx.data_source if ctx.data_source is not None else open_data(ctx.cfg)[1]


def open_data(cfg: RunConfig):
    """(cfg, source): the data the run reads, checked before any model loads, and ``cfg`` with
    ``data.num_tokens=all`` resolved to a number.

    The source is the tokens ``dofla-prepare`` wrote for this data and model when they exist
    (``data.prepared=auto``; ``require`` fails without them), else the data source's text.
    """
    from dofla.data import DataError, build_source
    from dofla.data.prepared import PreparedTokens

    text = build_source(cfg.data.name, **cfg.data.options)  # checks the files exist and are text
    if cfg.data.prepared == "off":
        return cfg, text
    directory = prepared_path(cfg, text)
    why = [setting for setting, needs in (("data.num_tokens=all", cfg.data.num_tokens == "all"),
                                          ("data.shuffle_seed", cfg.data.shuffle_seed is not None),
                                          ("data.prepared=require", cfg.data.prepared == "require")) if needs]
    if why and cfg.data.prepared == "auto" and text.prepares_itself:
        prepare(cfg)  # a small corpus shipped with the package: tokenised here (seconds), then reused
    if not (directory / "meta.json").is_file():
        if why:
            raise DataError(f"{why[0]} reads the prepared tokens of data={cfg.data.name} for model "
                            f"{cfg.model.source}, which are not in {directory.parent}; run `{PREPARE_HINT}` first")
        return cfg, text
    prepared = PreparedTokens(directory, command=PREPARE_HINT)
    prepared.check()
    prepared.require("heldout", *heldout_need(cfg))  # refused now, not after training (the eval reads it last)
    if cfg.data.shuffle_seed is not None:
        prepared = prepared.shuffled(cfg.data.seq_len, cfg.data.shuffle_seed)
    return resolve_num_tokens(cfg, prepared), prepared


def prepared_path(cfg: RunConfig, text_source):
    """Where ``dofla-prepare`` writes (and runs read) this data's tokens for this model's tokenizer."""
    from dofla.data.prepared import prepared_dir
    from dofla.models import cache_root as default_root

    root = Path(cfg.paths.cache_dir).expanduser() if cfg.paths.cache_dir else default_root()
    return prepared_dir(root, text_source.fingerprint(), cfg.model.source, cfg.model.revision)


def resolve_num_tokens(cfg: RunConfig, prepared) -> RunConfig:
    """``data.num_tokens=all``: every prepared training token, less the stream's cached sample and the
    tokens ``distill`` reads after the layerwise stage, in whole sequences; a number stays as it is."""
    from dofla.data import DataError

    if cfg.data.num_tokens != "all":
        return cfg
    total, L = prepared.available("train"), cfg.data.seq_len
    sample = 0 if cfg.train.source == "cache" else min(total, cfg.data.cache_tokens or STREAM_CACHE_TOKENS)
    reserved = cfg.distill.tokens if cfg.distill.name != "none" and cfg.distill.offset is None else 0
    tokens = (total - sample - reserved) // L * L
    if tokens < L:
        raise DataError(f"data.num_tokens=all leaves {max(tokens, 0)} tokens: the prepared training split holds "
                        f"{total:,}, the cached sample takes {sample:,} and distill.tokens {reserved:,}; prepare "
                        "more data or set data.num_tokens")
    return replace(cfg, data=replace(cfg.data, num_tokens=tokens))


def load_data(cfg: RunConfig, tokenizer, source=None, train_tokens: int | None = None):
    """(train tokens (S, L), held-out tokens (S', L), data fingerprint); ``source`` is opened when not
    given. ``train_tokens`` (default ``data.num_tokens``): how many training tokens to pack here (a
    streaming run packs only the cached sample; the stream reads the rest as it trains)."""
    from dofla.data.prepared import pack_split

    source = source or open_data(cfg)[1]
    train = pack_split(source, "train", tokenizer, cfg.data.seq_len, train_tokens or cfg.data.num_tokens,
                       desc="tokenize train")
    return train, pack_heldout(cfg, tokenizer, source), source.fingerprint()


def pack_heldout(cfg: RunConfig, tokenizer, source):
    """The held-out tokens (S', data.seq_len) every evaluation of this data measures on."""
    from dofla.data.prepared import pack_split

    return pack_split(source, "heldout", tokenizer, cfg.data.seq_len, cfg.data.heldout_tokens,
                      desc="tokenize held-out", setting="data.heldout_tokens")


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
    """One timed teacher forward of a (1, seq_len) batch, after a warm-up forward and with the device
    synchronised before and after (a GPU's first call and its asynchronous launch mislead): the
    throughput the predictions use."""
    device = next(teacher.parameters()).device
    ids = torch.randint(0, teacher.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    teacher(input_ids=ids, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    teacher(input_ids=ids, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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
    what = ("a stream of fresh token batches (end to end)" if end_to_end(cfg.loss.name) and source == "stream" else
            f"{'a stream of fresh' if source == 'stream' else 'cached'} teacher activations")
    print(f"dofla: training reads {what} "
          f"({why}); caching all {cfg.data.num_tokens:,} tokens would take {full / 2**30:.2f} GB, this run caches "
          f"{cached_tokens(cfg, source):,} tokens ({kept / 2**30:.2f} GB); the teacher runs at ≈ {rate:,.0f} tokens/s "
          f"here, so its passes over {cfg.data.num_tokens:,} tokens take ≈ {cfg.data.num_tokens / rate / 60:.1f} min"
          + (" (plus every layer's loss and update per step)" if source == "stream" and not end_to_end(cfg.loss.name)
             else ""), flush=True)
    hours = cfg.data.num_tokens / rate / 3600
    if cfg.device == "auto" and next(teacher.parameters()).device.type == "cpu" and hours > 1:
        print(f"dofla: WARNING: no GPU is visible, so device=auto runs on the CPU, where the teacher passes alone "
              f"are predicted to take {hours:.1f} h; set device=cuda to require a GPU (it then fails at once "
              "instead)", flush=True)
    return source


def training_stream(cfg: RunConfig, tokenizer, batch_size: int, skip_tokens: int, seq_len: int | None = None,
                    source=None):
    """The training split of ``source`` (default: opened from ``cfg``) as (batch_size, seq_len or
    data.seq_len) batches, after skipping the first ``skip_tokens`` (e.g. the activation cache's
    sample, which so stays held out). A worker thread reads ``data.prefetch`` batches ahead."""
    from dofla.data.prefetch import prefetched
    from dofla.data.prepared import train_stream

    batches = train_stream(source or open_data(cfg)[1], tokenizer, batch_size, seq_len or cfg.data.seq_len)
    batches.discard(skip_tokens)
    return prefetched(batches, cfg.data.prefetch)


def stream_steps(cfg: RunConfig, batch_tokens: int) -> int:
    """One pass over ``data.num_tokens`` (at least one step), or ``train.max_steps`` if smaller."""
    steps = cfg.data.num_tokens // batch_tokens
    if cfg.train.max_steps is not None:
        steps = min(steps, cfg.train.max_steps)
    return max(1, steps)


def heldout_need(cfg: RunConfig) -> tuple[int, str]:
    """(tokens, setting): the held-out tokens a run reads (the held-out set, or the long-context
    sequences of the loss by position when longer) and the setting that asks for them."""
    ev = cfg.eval
    long = ev.long_context_seqs * (ev.long_seq_len or cfg.data.seq_len) if ev.position_buckets else 0
    return (long, "eval.long_context_seqs") if long > cfg.data.heldout_tokens else \
        (cfg.data.heldout_tokens, "data.heldout_tokens")


def prepare_limits(cfg: RunConfig) -> tuple[int | None, int]:
    """Training and held-out tokens a run of ``cfg`` reads (training None: all of it, for
    ``data.num_tokens=all`` or a shuffled order): the cached sample, the stream, distill's tokens, the
    long held-out set."""
    heldout, _ = heldout_need(cfg)
    if cfg.data.num_tokens == "all" or cfg.data.shuffle_seed is not None:  # the whole split
        return None, heldout
    n = cfg.data.num_tokens
    layerwise = cached_tokens(cfg, "stream") + n
    start = cfg.distill.offset if cfg.distill.offset is not None else layerwise
    distilled = start + cfg.distill.tokens if cfg.distill.name != "none" else 0
    return max(layerwise, distilled), heldout


def prepare(cfg: RunConfig) -> tuple[Path, dict]:
    """``dofla-prepare``: tokenise the data a run of ``cfg`` reads, once, into the directory such runs
    look up (:func:`open_data`); kept when it already holds enough. Returns (directory, meta)."""
    from dofla.data import build_source
    from dofla.data.prepared import META, prepare as write
    from dofla.models import load_tokenizer
    from dofla.record import read_json

    text = build_source(cfg.data.name, **cfg.data.options)
    directory = prepared_path(cfg, text)
    train, heldout = prepare_limits(cfg)
    old = read_json(directory / META)
    if old is not None and all(old[split]["complete"] or (limit is not None and old[split]["tokens"] >= limit)
                               for split, limit in (("train", train), ("heldout", heldout))):
        print(f"dofla: {directory} already holds the prepared tokens this config reads", flush=True)
        return directory, old
    tokenizer = load_tokenizer(cfg.model.source, cfg.model.revision)
    meta = write(text, tokenizer, directory, train, heldout, tokenizer_source=cfg.model.source)
    return directory, meta
