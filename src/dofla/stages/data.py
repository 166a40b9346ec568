"""The data stage: where training reads activations from (cache or stream), and the token tensors.

The choice is printed before any teacher pass with the predicted disk use and teacher time; the
stream's batches come from :func:`~dofla.stages.sources.training_stream`, after the cached sample,
which so stays held out. The tokens each stage reads are the run's token ledger
(:class:`~dofla.stages.plan.TrainPlan`).
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from dofla.cache import cache_key, predict_cache_bytes
from dofla.config import RunConfig
from dofla.measure import teacher_tokens_per_second
from dofla.data import build_source
from dofla.data.prepared import META, pack_split
from dofla.data.split import heldout_range, test_tokens
from dofla.data.prepared import prepare as write
from dofla.models import load_tokenizer
from dofla.record import read_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import cache_fields
from dofla.stages.plan import CACHE, NO_SOURCE, STREAM, TrainPlan, train_plan
# the data a run reads, opened before loading (dofla-prepare, notebooks and tests call them from here)
from dofla.stages.sources import PREPARE_HINT, data_source, heldout_need, needs_prepared, open_data, prepared_path  # noqa: F401
from dofla.stages.sources import training_stream  # noqa: F401

logger = logging.getLogger(__name__)


def run(ctx: RunContext) -> RunData:
    """Pack the training tokens the cache needs (all of them, or the stream's cached sample) and the
    held-out tokens, from ``ctx.data_source`` (opened here when the context has none)."""
    cfg = ctx.cfg
    source = data_source(ctx)
    if hasattr(source, "check_tokenizer"):  # prepared tokens: made by this model's tokenizer?
        source.check_tokenizer(ctx.tokenizer)
    num_cached = ctx.train.ledger.cached
    train, heldout, fingerprint = load_data(cfg, ctx.tokenizer, source, num_cached)
    return RunData(train, heldout, fingerprint, cache_key(cache_fields(cfg, fingerprint, num_cached)))


def load_data(cfg: RunConfig, tokenizer, source=None, train_tokens: int | None = None):
    """(train tokens (S, L), held-out tokens (S', L), data fingerprint); ``source`` is opened when not
    given. ``train_tokens`` (default ``data.num_tokens``): how many training tokens to pack here (a
    streaming run packs only the cached sample; the stream reads the rest as it trains)."""
    source = source or open_data(cfg)[1]
    train = pack_split(source, "train", tokenizer, cfg.data.seq_len, train_tokens or cfg.data.num_tokens,
                       desc="tokenize train")
    return train, pack_heldout(cfg, tokenizer, source), source.fingerprint()


def pack_heldout(cfg: RunConfig, tokenizer, source):
    """The held-out tokens (S', data.seq_len) every evaluation of this data measures on: the first of
    the part ``open_data`` opened (``data.heldout_split``)."""
    if cfg.data.heldout_split == "test":  # the test part (open_data refused a source without one)
        return pack_split(source, "heldout", tokenizer, cfg.data.seq_len, test_tokens(cfg.data, source),
                          desc="tokenize held-out", setting="data.test_tokens")
    return pack_split(source, "heldout", tokenizer, cfg.data.seq_len, cfg.data.heldout_tokens,
                      desc="tokenize held-out", setting="data.heldout_tokens")


def capture_teacher(teacher, dtype: str):
    """The teacher whose forwards produce distillation activations: itself in fp32, else a copy in
    ``dtype`` (the fp32 teacher stays for evaluation and the student)."""
    if dtype == "float32":
        return teacher
    return copy.deepcopy(teacher).to(getattr(torch, dtype))


def plan_training(cfg: RunConfig, plan: list[str], geometry, teacher) -> TrainPlan:
    """The run's :class:`~dofla.stages.plan.TrainPlan`, its source chosen (``train.source``; ``auto``:
    stream when caching every distillation token would exceed ``train.cache_limit_gb``) and printed
    with the predicted disk use and teacher time before any teacher pass; source ``none`` when
    nothing trains."""
    if "train" not in plan:
        return train_plan(cfg, NO_SOURCE)
    n, L = cfg.data.num_tokens, cfg.data.seq_len
    full = predict_cache_bytes(geometry, n // L, L)
    over = full > cfg.train.cache_limit_gb * 2**30
    training = train_plan(cfg, {"auto": STREAM if over else CACHE}.get(cfg.train.source, cfg.train.source))
    cached = training.ledger.cached
    kept = predict_cache_bytes(geometry, cached // L, L)
    rate = teacher_tokens_per_second(teacher, L)
    why = {"auto": f"train.source=auto, limit {cfg.train.cache_limit_gb:g} GB"}.get(cfg.train.source,
                                                                                   f"train.source={training.source}")
    what = ("a stream of fresh token batches (end to end)" if training.direct and training.streams else
            f"{'a stream of fresh' if training.streams else 'cached'} teacher activations")
    logger.info(f"dofla: training reads {what} "
          f"({why}); caching all {n:,} tokens would take {full / 2**30:.2f} GB, this run caches "
          f"{cached:,} tokens ({kept / 2**30:.2f} GB); the teacher runs at ≈ {rate:,.0f} tokens/s "
          f"here, so its passes over {n:,} tokens take ≈ {n / rate / 60:.1f} min"
          + (" (plus every layer's loss and update per step)" if training.streams and not training.direct
             else ""))
    hours = n / rate / 3600
    if cfg.device == "auto" and next(teacher.parameters()).device.type == "cpu" and hours > 1:
        logger.warning(f"dofla: WARNING: no GPU is visible, so device=auto runs on the CPU, where the teacher passes alone "
              f"are predicted to take {hours:.1f} h; set device=cuda to require a GPU (it then fails at once "
              "instead)")
    return training


def prepare_limits(cfg: RunConfig) -> tuple[int | None, int]:
    """Training and held-out tokens a run of ``cfg`` reads (training None: all of it, for
    ``data.num_tokens=all`` or a shuffled order): the cached sample, the stream, distill's tokens, the
    long held-out set, whichever source the run chooses (the stream's ledger reads the most); held-out
    tokens counted from the first, the dev part included when the run scores the test part."""
    _, heldout = heldout_range(cfg.data, heldout_need(cfg)[0])
    if cfg.data.num_tokens == "all" or cfg.data.shuffle_seed is not None:  # the whole split
        return None, heldout
    ledger = train_plan(cfg, STREAM).ledger
    layerwise = ledger.cached + ledger.streamed
    distilled = ledger.kl_offset + ledger.kl_tokens if ledger.kl_tokens else 0
    return max(layerwise, distilled), heldout


def prepare(cfg: RunConfig) -> tuple[Path, dict]:
    """``dofla-prepare``: tokenise the data a run of ``cfg`` reads, once, into the directory such runs
    look up (:func:`open_data`); kept when it already holds enough. Returns (directory, meta)."""
    text = build_source(cfg.data.name, **cfg.data.options)
    directory = prepared_path(cfg, text)
    train, heldout = prepare_limits(cfg)
    old = read_json(directory / META)
    if old is not None and all(old[split]["complete"] or (limit is not None and old[split]["tokens"] >= limit)
                               for split, limit in (("train", train), ("heldout", heldout))):
        logger.info(f"dofla: {directory} already holds the prepared tokens this config reads")
        return directory, old
    tokenizer = load_tokenizer(cfg.model.source, cfg.model.revision)
    meta = write(text, tokenizer, directory, train, heldout, tokenizer_source=cfg.model.source)
    return directory, meta


def open_or_prepare(cfg: RunConfig):
    """:func:`open_data`, after tokenising a corpus shipped with the package (seconds, then reused) when
    the run reads prepared tokens (``data.prepared=auto``): a run never asks for ``dofla-prepare`` on
    data it can prepare itself."""
    shipped = build_source(cfg.data.name, **cfg.data.options).prepares_itself
    if cfg.data.prepared == "auto" and needs_prepared(cfg) and shipped:
        prepare(cfg)
    return open_data(cfg)
