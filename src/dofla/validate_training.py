"""Value checks of the training options: the distill stage, how a hybrid's linear part learns, the
decay gate and the linear scale (part of :func:`dofla.validate.validate_config`; one clear sentence per bad value)."""
from __future__ import annotations

import os
import shutil

import torch

from dofla.attention.forms import get_form
from dofla.attention.gate import GATES
from dofla.config import RunConfig
from dofla.data.copies import SPAN
from dofla.errors import require
from dofla.models.plan import read_plan
from dofla.models.spec import LINEAR_SCALES
from dofla.stages.plan import DIRECT, training_mode
from dofla.train.distill import TRAINABLE
from dofla.value_checks import one_of, positive  # noqa: F401 - API

SCHEDULES = ("constant", "cosine")
HYBRID_TARGETS = ("hybrid", "full")


def validate_training(cfg: RunConfig) -> None:
    _validate_distill(cfg)
    _validate_hybrid_training(cfg)
    _validate_delta(cfg)
    _validate_gate(cfg)
    _validate_linear_scale(cfg)
    _validate_compile(cfg)


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile would build CPU kernels with (``$CXX``, else g++ / c++ /
    clang++ on the PATH), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((found for name in names if (found := shutil.which(name))), None)


def _validate_compile(cfg: RunConfig) -> None:
    """``train.compile`` compiles the layer loss: useless end to end, and on the CPU it needs a compiler."""
    if not cfg.train.compile:
        return
    require(training_mode(cfg) != DIRECT,
            f"train.compile=true compiles the layerwise loss, and loss={cfg.loss.name} has none to compile; "
            "unset train.compile")
    gpu = str(cfg.device).startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    require(gpu or cxx_compiler() is not None,
            "train.compile=true on the CPU needs a C++ compiler (g++, c++ or clang++ on the PATH, or $CXX), and "
            "none was found; install one (apt install g++) or unset train.compile")


def _validate_gate(cfg: RunConfig) -> None:
    a, d = cfg.attention, cfg.distill
    one_of("attention.gate", a.gate, GATES)
    if a.gate == "none":
        return
    require(get_form(a.name).traits.gate and cfg.feature_map.name != "softmax",
            f"attention.gate={a.gate} decays a linear state (linear or hybrid layers); attention={a.name} with "
            f"feature_map={cfg.feature_map.name} has none, use attention=linear or hybrid, or attention.gate=none")
    require(d.name == "kl" and "gate" in d.train, f"attention.gate={a.gate} starts closed (the ungated student) "
            f"and only the distill stage trains it: set distill=kl and name gate in distill.train (now "
            f"distill={d.name}, distill.train={list(d.train)})")


def _has_hybrid_layers(cfg: RunConfig) -> bool:
    """attention=hybrid, or linear with a window (what it meant before ``attention.name`` existed), or
    gated_delta with a window (the hybrid whose older tokens live in a delta state)."""
    a = cfg.attention
    if a.plan:  # a plan's heads: any window kept before a linear state of either kind
        try:
            layers = read_plan(a.plan).layers
        except ValueError:  # the plan's own check names what is wrong with the file, in its sentence
            return False
        return any(h.window not in (0, "all") and h.state != "none" for layer in layers for h in layer)
    return a.window > 0 and get_form(a.name).traits.state in ("additive", "delta")


DELTA_LOSSES = ("output", "direct")


def _validate_delta(cfg: RunConfig) -> None:
    """attention=gated_delta: what it trains with and what it does not take."""
    a = cfg.attention
    if get_form(a.name).traits.state != "delta":
        return
    require(cfg.loss.name in DELTA_LOSSES, f"loss={cfg.loss.name} compares attention kernels, and a gated-delta "
            "layer has no normalised kernel to compare (its read is a decayed, overwritten state); use loss=output "
            "(its attention output against the teacher's) or loss=direct")
    require(cfg.allocation.policy != "dof_head", "allocation.policy=dof_head gives heads their own feature dims, "
            "and a gated-delta layer runs its heads batched with one dim; use dof, dof_clip, fix, fix_max, measured or given")
    require(a.linear_scale == "fixed", f"attention.linear_scale={a.linear_scale} weighs an additive linear part; "
            "a gated-delta layer weighs its older tokens by their kernel mass, set attention.linear_scale=fixed")
    require(not cfg.train.compile, "train.compile compiles the additive kernels' losses and has not been made "
            "to compile the delta rule; unset train.compile with attention=gated_delta")


def _validate_linear_scale(cfg: RunConfig) -> None:
    a, d = cfg.attention, cfg.distill
    one_of("attention.linear_scale", a.linear_scale, LINEAR_SCALES)
    if a.linear_scale == "fixed":
        return
    require(_has_hybrid_layers(cfg) and cfg.feature_map.name != "softmax",
            f"attention.linear_scale={a.linear_scale} weighs a hybrid's linear part against its window; "
            f"attention={a.name} has no such part (in pure linear attention a scale cancels), use attention=hybrid "
            "or attention.linear_scale=fixed")
    require(d.name == "kl" and "features" in d.train, f"attention.linear_scale={a.linear_scale} starts at 1 (the "
            f"unscaled student) and the distill stage trains it with the features: set distill=kl and name features "
            f"in distill.train (now distill={d.name}, distill.train={list(d.train)})")


def _validate_hybrid_training(cfg: RunConfig) -> None:
    a, target = cfg.attention, cfg.train.hybrid_target
    one_of("train.hybrid_target", target, HYBRID_TARGETS)
    hybrid = _has_hybrid_layers(cfg)
    require(target == "hybrid" or hybrid, f"train.hybrid_target={target} trains a hybrid's linear part against "
            f"full attention; attention={a.name} has no hybrid layers, leave it at hybrid")
    require(target == "hybrid" or training_mode(cfg) != DIRECT, "train.hybrid_target=full sets what the layerwise "
            "losses compare; loss=direct trains end to end, so use distill.window_dropout for that instead")
    d = cfg.distill
    for key in ("window_dropout", "window_dropout_end"):
        p = getattr(d, key)
        require(p is None or (isinstance(p, (int, float)) and 0 <= p <= 1),
                f"distill.{key}={p!r} must be a probability in [0, 1]")
    dropout = d.window_dropout or d.window_dropout_end
    require(not dropout or (hybrid and d.name != "none"), f"distill.window_dropout drops the exact window of a "
            f"hybrid student's layers during distillation; it needs distill=kl and attention=hybrid "
            f"(here distill={d.name}, attention={a.name})")


def _validate_distill(cfg: RunConfig) -> None:
    d = cfg.distill
    one_of("distill.name", d.name, ("none", "kl"))
    if d.name == "none":
        return
    one_of("distill.schedule", d.schedule, SCHEDULES)
    for key in ("tokens", "batch_size", "lr", "feature_lr", "temperature", "lora_rank", "checkpoint_every",
                "log_every"):
        positive(f"distill.{key}", getattr(d, key))
    require(isinstance(d.passes, int) and not isinstance(d.passes, bool) and d.passes >= 1,
            f"distill.passes={d.passes!r} must be a whole number ≥ 1 (1: the KL text is read once)")
    require(d.passes == 1 or cfg.data.prepared != "off", f"distill.passes={d.passes} reads the KL text again "
            "from prepared tokens, which data.prepared=off turns off; set data.prepared=auto")
    if d.seq_len is not None:
        positive("distill.seq_len", d.seq_len)
    require(isinstance(d.logit_chunk, int) and d.logit_chunk >= 0,
            f"distill.logit_chunk={d.logit_chunk!r} must be 0 (the whole sequence) or a number of positions")
    if d.micro_batch_size not in (None, "auto"):
        positive("distill.micro_batch_size", d.micro_batch_size)
    require(d.micro_batch_size in (None, "auto") or d.batch_size % d.micro_batch_size == 0,
            f"distill.micro_batch_size={d.micro_batch_size} does not divide distill.batch_size={d.batch_size}; "
            "choose a divisor so every micro-batch has the same size")
    unknown = [t for t in d.train if t not in TRAINABLE]
    require(d.train and not unknown, f"distill.train={list(d.train)} must name one or more of "
            f"{', '.join(TRAINABLE)}" + (f" ({', '.join(map(str, unknown))} is not one)" if unknown else ""))
    seq_len = d.seq_len or cfg.data.seq_len
    require(d.tokens >= d.batch_size * seq_len,
            f"distill.tokens={d.tokens} is less than one batch ({d.batch_size} × {seq_len} tokens); "
            "raise distill.tokens or lower distill.batch_size")
    require(d.offset is None or d.offset >= 0, f"distill.offset={d.offset} must be ≥ 0 (or null: after the "
            "layerwise stage's tokens)")
    require(d.grad_clip >= 0 and d.warmup_steps >= 0,
            "distill.grad_clip and distill.warmup_steps must be ≥ 0")
    _validate_copies(d, seq_len)
    _validate_teacher_targets(d)


def _validate_teacher_targets(d) -> None:
    one_of("distill.teacher_cache", d.teacher_cache, ("auto", "off"))
    require(isinstance(d.teacher_topk, int) and d.teacher_topk >= 0,
            f"distill.teacher_topk={d.teacher_topk!r} must be 0 (the whole distribution) or a number of tokens")
    positive("distill.teacher_cache_gb", d.teacher_cache_gb)


def _validate_copies(d, seq_len: int) -> None:
    require(isinstance(d.copy_share, (int, float)) and 0 <= d.copy_share <= 0.5,
            f"distill.copy_share={d.copy_share!r} must be a share of the tokens in [0, 0.5] (0: no far copies)")
    require(isinstance(d.copy_distance, int) and d.copy_distance >= 1,
            f"distill.copy_distance={d.copy_distance!r} must be a number of tokens ≥ 1")
    need = d.copy_distance + 2 * SPAN[0]
    require(not d.copy_share or seq_len >= need, f"distill.copy_share plants copies {d.copy_distance} tokens "
            f"(distill.copy_distance) after their source, which needs sequences of at least {need} tokens; "
            f"distill.seq_len is {seq_len}: raise it or lower distill.copy_distance")
