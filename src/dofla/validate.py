"""Checks that run before any model is loaded: one clear sentence per bad value.

Each error names the config key, the bad value and what would be valid, so a sweep of 27 jobs
fails in a second instead of after an hour of caching.
"""
from __future__ import annotations

import os
from pathlib import Path

from dofla.attention import ATTENTION_FORMS
from dofla.attention.forms import REQUIRED, get_form
from dofla.config import RunConfig
from dofla.data import DATA_SOURCES
from dofla.data.prepared import PREPARED_MODES
from dofla.distributed import check_device
from dofla.dof.budget import feature_budget  # noqa: F401 - API
from dofla.dof.checks import validate_allocation, validate_allocation_against_model
from dofla.errors import ConfigError, require
from dofla.eval.checks import validate_eval, validate_eval_against_model
from dofla.feature_maps import FEATURE_MAPS
from dofla.options import DATA_PASSED, FEATURE_MAP_PASSED, LOSS_PASSED, declared_options, option_problem
from dofla.precision import SETTINGS
from dofla.stages.plan import DIRECT, stage_plan, training_mode
from dofla.train.layerwise import mean_over_rows
from dofla.train.losses import LOSSES, next_token_loss
from dofla.validate_training import SCHEDULES, one_of, positive, validate_training

TRAIN_SOURCES = ("auto", "cache", "stream")
TEACHER_DTYPES = ("float32", "bfloat16", "float16")


def validate_config(cfg: RunConfig) -> None:
    """Everything that can be checked without loading a model or data."""
    one_of("feature_map.name", cfg.feature_map.name, FEATURE_MAPS.names())
    one_of("loss.name", cfg.loss.name, [*LOSSES.names(), DIRECT])  # a layer loss, or the direct training mode
    validate_allocation(cfg)
    one_of("data.name", cfg.data.name, DATA_SOURCES.names())
    one_of("train.schedule", cfg.train.schedule, SCHEDULES)
    check_device(cfg.device)
    one_of("precision", cfg.precision, SETTINGS)
    for key, value in [
        ("data.seq_len", cfg.data.seq_len),
        ("data.heldout_tokens", cfg.data.heldout_tokens),
        ("train.batch_size", cfg.train.batch_size),
        ("train.checkpoint_every", cfg.train.checkpoint_every),
        ("train.eval_every", cfg.train.eval_every),
        ("train.lr_z", cfg.train.lr_z),
        ("train.lr_alpha", cfg.train.lr_alpha),
        ("eval.batch_size", cfg.eval.batch_size),
        ("finetune.steps", cfg.finetune.steps),
        ("finetune.lr", cfg.finetune.lr),
        ("finetune.rank", cfg.finetune.rank),
    ]:
        positive(key, value)
    chunk = cfg.attention.chunk_size
    require(chunk == "auto" or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0),
            f"attention.chunk_size={chunk!r} must be a positive number of tokens or auto (measured on this machine)")
    require(chunk != "auto" or cfg.attention.name == "linear",
            f"attention.chunk_size=auto tunes the linear kernel, and attention={cfg.attention.name} chunks by its "
            "window; give a number")
    if cfg.train.micro_batch_size is not None:
        if cfg.train.micro_batch_size != "auto":
            positive("train.micro_batch_size", cfg.train.micro_batch_size)
        require(training_mode(cfg) == DIRECT or mean_over_rows(cfg.loss.name),
                f"train.micro_batch_size does not work with loss={cfg.loss.name}: its value is a ratio over "
                "the whole batch, which micro-batches cannot add up to; unset train.micro_batch_size or "
                "lower train.batch_size")
    for key, value in [("train.steps", cfg.train.steps), ("data.prefetch", cfg.data.prefetch)]:
        require(value >= 0, f"{key}={value!r} must be 0 or more")
    require(cfg.train.memory_limit_gb is None or cfg.train.memory_limit_gb > 0,
            f"train.memory_limit_gb={cfg.train.memory_limit_gb} must be a positive number of GiB (or null: the device's)")
    require(0 <= cfg.train.heldout_fraction < 1,
             f"train.heldout_fraction={cfg.train.heldout_fraction!r} must be in [0, 1)")
    _validate_num_tokens(cfg)
    one_of("logger.name", cfg.logger.name, ("none", "wandb"))
    one_of("finetune.name", cfg.finetune.name, ("none", "lora"))
    validate_training(cfg)
    _validate_attention(cfg)
    _validate_scale(cfg)
    stage_plan(cfg)
    _validate_options(cfg)
    validate_eval(cfg)


def _validate_num_tokens(cfg: RunConfig) -> None:
    one_of("data.prepared", cfg.data.prepared, PREPARED_MODES)
    require(cfg.data.shuffle_seed is None or cfg.data.prepared != "off", "data.shuffle_seed reads the prepared "
            "training split in a random order, which data.prepared=off turns off; set data.prepared=auto")
    n = cfg.data.num_tokens
    if n == "all":  # resolved to a number from the prepared data (dofla.stages.data.open_data)
        return require(cfg.data.prepared != "off", "data.num_tokens=all reads the prepared training split, which "
                       "data.prepared=off turns off; set data.prepared=auto or a number of tokens")
    require(isinstance(n, int) and not isinstance(n, bool),
             f"data.num_tokens={n!r} must be a number of tokens or 'all' (one pass over the prepared data)")
    positive("data.num_tokens", n)
    require(n >= cfg.data.seq_len, f"data.num_tokens={n} is less than one sequence of data.seq_len="
             f"{cfg.data.seq_len}; raise data.num_tokens or lower data.seq_len")


def _validate_attention(cfg: RunConfig) -> None:
    a = cfg.attention
    one_of("attention.name", a.name, ATTENTION_FORMS)
    require(a.window >= 0, f"attention.window={a.window!r} must be 0 (pure linear) or a positive number of tokens")
    require(a.sinks >= 0, f"attention.sinks={a.sinks!r} must be 0 or a positive number of tokens")
    traits = get_form(a.name).traits
    if traits.window == REQUIRED:
        require(a.window >= 1, f"attention={a.name} needs attention.window ≥ 1 (the exact softmax window), "
                                f"got {a.window}")
    require(a.sinks == 0 or traits.window == REQUIRED or a.window > 0,
             f"attention.sinks={a.sinks} needs an exact part to keep sinks in: attention=hybrid, sliding_window, or "
             "gated_delta with attention.window > 0")
    require(not cfg.eval.ablate_linear or (traits.state != "none" and a.window > 0),
             "eval.ablate_linear=true removes a hybrid student's linear part; it needs attention=hybrid")


def _validate_scale(cfg: RunConfig) -> None:
    """Streaming and the bounded cache."""
    t = cfg.train
    one_of("train.source", t.source, TRAIN_SOURCES)
    one_of("train.parallel", t.parallel, ("auto", "data", "layers"))
    require(t.parallel != "data" or t.source != "cache",
            "train.parallel=data splits a stream's batches over torchrun's ranks, and train.source=cache has no "
            "stream; use train.source=stream, or train.parallel=layers (or auto) for the cache")
    one_of("train.teacher_dtype", t.teacher_dtype, TEACHER_DTYPES)
    positive("train.cache_limit_gb", t.cache_limit_gb)
    if t.max_steps is not None:
        positive("train.max_steps", t.max_steps)
    if cfg.data.cache_tokens is not None:
        require(cfg.data.cache_tokens >= 2 * cfg.data.seq_len,
                 f"data.cache_tokens={cfg.data.cache_tokens} must hold at least two sequences of "
                 f"data.seq_len={cfg.data.seq_len} (one to train on, one held out)")


def _validate_options(cfg: RunConfig) -> None:
    """feature_map/loss/data options against the signature of what they are passed to."""
    fm, loss, data = cfg.feature_map, cfg.loss, cfg.data
    loss_fn = next_token_loss if training_mode(cfg) == DIRECT else LOSSES.get(loss.name)
    for key, owner, declared, given in [
        ("feature_map.options", f"feature map {fm.name!r}",
         declared_options(FEATURE_MAPS.get(fm.name), FEATURE_MAP_PASSED), fm.options),
        ("loss.options", f"loss {loss.name!r}", declared_options(loss_fn, LOSS_PASSED), loss.options),
        ("data.options", f"data source {data.name!r}", declared_options(DATA_SOURCES.get(data.name), DATA_PASSED),
         data.options),
    ]:
        problem = option_problem(key, owner, declared, given)
        require(problem is None, problem or "")


def validate_against_model(cfg: RunConfig, num_layers: int, head_dim: int, max_positions: int) -> None:
    """Checks that need the model's geometry (read from its config, before any compute)."""
    validate_allocation_against_model(cfg, num_layers, head_dim)
    if cfg.train.layers is not None:
        bad = [i for i in cfg.train.layers if not (isinstance(i, int) and 0 <= i < num_layers)]
        require(
            not bad and len(cfg.train.layers) > 0,
            f"train.layers={list(cfg.train.layers)} has entries outside 0..{num_layers - 1} "
            f"(the model has {num_layers} layers)",
        )
    require(cfg.data.seq_len <= max_positions,
            f"data.seq_len={cfg.data.seq_len} exceeds the model's context of {max_positions} tokens")
    distill_len = cfg.distill.seq_len or cfg.data.seq_len
    require(cfg.distill.name == "none" or distill_len <= max_positions,
            f"distill.seq_len={distill_len} exceeds the model's context of {max_positions} tokens")
    validate_eval_against_model(cfg, max_positions)


def validate_output_dir(out_dir: Path) -> None:
    """The run directory must be creatable and writable."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output directory {out_dir} cannot be created ({err.strerror}); "
                          "choose a writable hydra.run.dir") from None
    require(os.access(out_dir, os.W_OK), f"output directory {out_dir} is not writable; "
             "choose a writable hydra.run.dir")
