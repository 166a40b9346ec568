"""Where a run's data comes from and where its caches live, shared by the stages that read them (a
module of helpers, not a stage): the data opened before loading, the training stream after the
cached sample, and the activation cache's directory."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dofla.config import RunConfig
from dofla.data import DataError, build_source
from dofla.data.prefetch import prefetched
from dofla.data.prepared import PreparedTokens, prepared_dir, train_stream
from dofla.data.split import check_heldout_split, test_part
from dofla.models import cache_root as default_root
from dofla.stages.plan import reserved_tokens

PREPARE_HINT = "dofla-prepare <this run's overrides>"


def data_source(ctx):
    """The run's data: the one opened before loading, else opened now."""
    return ctx.data_source if ctx.data_source is not None else open_data(ctx.cfg)[1]


def open_data(cfg: RunConfig):
    """(cfg, source): the data the run reads, checked before any model loads, and ``cfg`` with
    ``data.num_tokens=all`` resolved to a number.

    The source is the tokens ``dofla-prepare`` wrote for this data and model when they exist
    (``data.prepared=auto``; ``require`` fails without them), else the data source's text.
    """
    check_heldout_split(cfg.data, *heldout_need(cfg))
    text = build_source(cfg.data.name, **cfg.data.options)  # checks the files exist and are text
    if cfg.data.prepared == "off":
        if cfg.data.heldout_split == "test":
            raise DataError("data.heldout_split=test reads the test part from prepared tokens, which "
                            "data.prepared=off turns off; set data.prepared=auto")
        return cfg, text
    directory = prepared_path(cfg, text)
    if not (directory / "meta.json").is_file():
        why = needs_prepared(cfg)
        if why:
            raise DataError(f"{why[0]} reads the prepared tokens of data={cfg.data.name} for model "
                            f"{cfg.model.source}, which are not in {directory.parent}; run `{PREPARE_HINT}` first")
        return cfg, text
    prepared = PreparedTokens(directory, command=PREPARE_HINT)
    prepared.check()
    if cfg.data.heldout_split == "test":
        prepared = test_part(prepared, cfg.data, *heldout_need(cfg))
    prepared.require("heldout", *heldout_need(cfg))  # refused now, not after training (the eval reads it last)
    if cfg.data.shuffle_seed is not None:
        prepared = prepared.shuffled(cfg.data.seq_len, cfg.data.shuffle_seed)
    return resolve_num_tokens(cfg, prepared), prepared


def needs_prepared(cfg: RunConfig) -> list[str]:
    """The settings of ``cfg`` that read prepared tokens (a run with none of them can read the text)."""
    return [setting for setting, needs in (("data.num_tokens=all", cfg.data.num_tokens == "all"),
                                           ("data.shuffle_seed", cfg.data.shuffle_seed is not None),
                                           ("data.heldout_split=test", cfg.data.heldout_split == "test"),
                                           ("data.prepared=require", cfg.data.prepared == "require"),
                                           (f"distill.passes={cfg.distill.passes}",
                                            cfg.distill.name == "kl" and cfg.distill.passes > 1)) if needs]


def prepared_path(cfg: RunConfig, text_source):
    """Where ``dofla-prepare`` writes (and runs read) this data's tokens for this model's tokenizer."""
    root = Path(cfg.paths.cache_dir).expanduser() if cfg.paths.cache_dir else default_root()
    return prepared_dir(root, text_source.fingerprint(), cfg.model.source, cfg.model.revision)


def resolve_num_tokens(cfg: RunConfig, prepared) -> RunConfig:
    """``data.num_tokens=all``: every prepared training token, less the stream's cached sample and the
    tokens ``distill`` reads after the layerwise stage, in whole sequences; a number stays as it is."""
    if cfg.data.num_tokens != "all":
        return cfg
    total, L = prepared.available("train"), cfg.data.seq_len
    sample, reserved = reserved_tokens(cfg, total)
    tokens = (total - sample - reserved) // L * L
    if tokens < L:
        raise DataError(f"data.num_tokens=all leaves {max(tokens, 0)} tokens: the prepared training split holds "
                        f"{total:,}, the cached sample takes {sample:,} and distill.tokens {reserved:,}; prepare "
                        "more data or set data.num_tokens")
    return replace(cfg, data=replace(cfg.data, num_tokens=tokens))


def heldout_need(cfg: RunConfig) -> tuple[int, str]:
    """(tokens, setting): the held-out tokens a run reads from the start of its part of the held-out
    text (:mod:`dofla.data.split`): the held-out set (dev: ``data.heldout_tokens``; test:
    ``data.test_tokens``, or one sequence at least when it is None, all; in whole sequences), or the long-context sequences
    of the loss by position when longer, and the setting that asks for them."""
    ev, d = cfg.eval, cfg.data
    long = ev.long_context_seqs * (ev.long_seq_len or d.seq_len) if ev.position_buckets else 0
    tokens, setting = (d.test_tokens or d.seq_len, "data.test_tokens") if d.heldout_split == "test" else \
        (d.heldout_tokens, "data.heldout_tokens")
    tokens = -(-tokens // d.seq_len) * d.seq_len  # read in whole sequences
    return (long, "eval.long_context_seqs") if long > tokens else (tokens, setting)


def training_stream(cfg: RunConfig, tokenizer, batch_size: int, skip_tokens: int, seq_len: int | None = None,
                    source=None, passes: int = 1):
    """The training split of ``source`` (default: opened from ``cfg``) as (batch_size, seq_len or
    data.seq_len) batches, after skipping the first ``skip_tokens`` (e.g. the activation cache's
    sample, which so stays held out); read ``passes`` times, each pass after the first in an order of
    ``seed``'s (:class:`~dofla.data.prepared.TokenStream`). A worker thread reads ``data.prefetch`` batches ahead."""
    batches = train_stream(source or open_data(cfg)[1], tokenizer, batch_size, seq_len or cfg.data.seq_len,
                           passes=passes, seed=cfg.seed)
    batches.discard(skip_tokens)
    return prefetched(batches, cfg.data.prefetch)


def stream_steps(cfg: RunConfig, batch_tokens: int) -> int:
    """One pass over ``data.num_tokens`` (at least one step), or ``train.max_steps`` if smaller."""
    steps = cfg.data.num_tokens // batch_tokens
    if cfg.train.max_steps is not None:
        steps = min(steps, cfg.train.max_steps)
    return max(1, steps)


def cache_root(cfg: RunConfig) -> Path:
    """Where activation caches live: ``paths.cache_dir``, else DOFLA_CACHE_DIR or the user cache."""
    return Path(cfg.paths.cache_dir).expanduser() if cfg.paths.cache_dir else default_root() / "activations"
