"""The stage graph and the training recipe, each decided once.

    load ─▶ data ─▶ cache ─▶ dof ─▶ allocate ─▶ train ─▶ assemble ─▶ distill ─▶ finetune ─▶ eval ─▶ report

``load`` and ``data`` always run; the others are listed in ``cfg.stages`` (default: all but ``dof``,
which runs when the allocation policy needs it). :func:`stage_plan` closes the list over what each
listed stage needs, before any model loads.

:class:`TrainPlan` is how the run trains (the mode, where training reads, and the token ledger: which
tokens of the training text each stage reads); :func:`train_plan` builds it once, when the run is
loaded and the source is chosen, and every stage reads it from the run context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dofla.attention.forms import get_form, selectable
from dofla.config import RunConfig
from dofla.dof.allocate import reads_dof
from dofla.dof.config import BUDGET_POLICY
from dofla.errors import require
from dofla.train.distill import DistillSchedule

STAGES = ("cache", "dof", "allocate", "train", "assemble", "distill", "finetune", "eval", "report")
PREPARATION = ("cache", "dof", "allocate")  # computed when a listed stage needs them, listed or not
# attention forms with nothing to train: no cache, dof, allocate, train
TRAINING_FREE = tuple(name for name in selectable() if not get_form(name).traits.trains)


def stage_needs(cfg: RunConfig) -> dict[str, tuple[str, ...]]:
    """The stages each stage reads the artifact of, for this config (see stage_plan)."""
    if cfg.attention.name in TRAINING_FREE:  # nothing to allocate or train: assemble from the teacher
        return {"assemble": (), "distill": ("assemble",), "finetune": ("assemble",), "eval": ("assemble",), "report": ("eval",)}
    if cfg.attention.plan is not None:  # the plan holds every head's feature dims: nothing to estimate or allocate
        return {"train": ("cache",), "assemble": ("train",), "distill": ("assemble",), "finetune": ("assemble",),
                "eval": ("assemble",), "report": ("eval",)}
    return {
        "dof": ("cache",),
        "allocate": ("dof",) if reads_dof(cfg.allocation.policy) or _sizes_by_dof(cfg) else (),
        "train": ("cache", "allocate"),  # direct needs only the cache's key (dofla.stages.train)
        "assemble": ("allocate", "train"),
        "distill": ("assemble",),
        "finetune": ("assemble",),
        "eval": ("assemble",),
        "report": ("eval",),
    }


def _sizes_by_dof(cfg: RunConfig) -> bool:
    """The memory-budget allocator sizing its linear states by DoF (``budget.state_sizing=dof``)."""
    return cfg.allocation.policy == BUDGET_POLICY and cfg.budget.state_sizing == "dof"


def stage_plan(cfg: RunConfig) -> list[str]:
    """The stages this run executes, in pipeline order.

    The listed stages run; the preparation stages (cache, dof, allocate) a listed stage needs are
    computed too (they are shared and deterministic); a later stage a listed one needs (train,
    assemble, eval) must be listed, else the run fails naming it. So ``dof`` (Algorithm 1) runs
    when the allocation policy needs it, and under ``fix`` only when listed. ``distill`` and
    ``finetune`` run when their name turns them on (:func:`switched_stages`) and the list reaches them.
    """
    unknown = [s for s in cfg.stages if s not in STAGES]
    if not unknown:
        cfg = _drop_switched_off(cfg)
    if cfg.attention.name in TRAINING_FREE:  # its student needs no cache, DoF, allocation or training
        cfg = replace(cfg, stages=[s for s in cfg.stages if s not in (*PREPARATION, "train")])
    if cfg.attention.plan is not None:  # a plan given whole sets the dims the allocation would
        cfg = replace(cfg, stages=[s for s in cfg.stages if s not in ("dof", "allocate")])
    require(not unknown, f"stages={list(cfg.stages)} names unknown stage(s) {', '.join(map(str, unknown))}; "
             f"valid stages: {', '.join(STAGES)}")
    needs, chosen, missing = stage_needs(cfg), set(cfg.stages), []
    for stage in reversed(STAGES):  # every stage needs only earlier ones, so one backward pass closes the set
        if stage not in chosen:
            continue
        for need in needs.get(stage, ()):
            if need not in chosen and need not in PREPARATION:
                missing.append(need)
            chosen.add(need)
    order = [s for s in STAGES if s in chosen]
    require(not missing, f"stages={list(cfg.stages)} leaves out {', '.join(s for s in STAGES if s in missing)}, "
             f"which the listed stages need; use stages=[{','.join(order)}]")
    return order


def switched_stages(cfg: RunConfig) -> dict[str, bool]:
    """The optional stages and whether the config turns each on: ``distill`` and ``finetune`` by their
    name (``distill=kl``, ``finetune=lora``; ``none`` is off). The name is the switch; the ``stages``
    list only says how far a run goes (a stage that is off is dropped from it)."""
    return {"distill": cfg.distill.name != "none", "finetune": cfg.finetune.name != "none"}


def _drop_switched_off(cfg: RunConfig) -> RunConfig:
    """``cfg`` without the listed stages that are off; refuses a list that runs past a stage that is on."""
    listed = list(cfg.stages)
    for stage, on in switched_stages(cfg).items():
        later = [s for s in STAGES[STAGES.index(stage) + 1:] if s in listed]
        require(not on or stage in listed or not later,
                f"stages={listed} runs {', '.join(later)} but leaves out {stage}, which {stage}="
                f"{getattr(cfg, stage).name} turns on; list {stage} too, or set {stage}=none to run without it")
    off = [stage for stage, on in switched_stages(cfg).items() if not on]
    return replace(cfg, stages=[s for s in listed if s not in off])


LAYERWISE, DIRECT = "layerwise", "direct"
TRAIN_MODES = (LAYERWISE, DIRECT)
CACHE, STREAM, NO_SOURCE = "cache", "stream", "none"
STREAM_CACHE_TOKENS = 8192  # data.cache_tokens default when training streams


def training_mode(cfg: RunConfig) -> str:
    """``direct`` for ``loss=direct`` (the user-facing value: the whole student trained end to end on
    next-token loss), else ``layerwise`` (each layer's features on their own, with ``loss.name``)."""
    return DIRECT if cfg.loss.name == DIRECT else LAYERWISE


@dataclass(frozen=True)
class TokenLedger:
    """Which tokens of the training text each stage reads, in tokens (whole sequences are packed).

    ``cached``: tokens whose teacher activations go to the cache (the data stage packs them; the
    cache key records this number); ``streamed``: fresh tokens a stream trains on after them;
    ``skipped``: tokens a stream skips first (the packed cached sample, so it stays held out);
    ``kl_offset`` and ``kl_tokens``: where the distill stage starts reading and how much (0: off);
    ``heldout``: the held-out tokens every evaluation measures on.
    """

    cached: int
    streamed: int
    skipped: int
    kl_offset: int
    kl_tokens: int
    heldout: int


@dataclass(frozen=True)
class TrainPlan:
    """How this run trains, resolved once: ``mode`` (``layerwise`` | ``direct``), ``source`` (``cache``,
    ``stream``, or ``none`` when nothing trains) and the token :class:`TokenLedger`."""

    mode: str
    source: str
    ledger: TokenLedger

    @property
    def direct(self) -> bool:
        return self.mode == DIRECT

    @property
    def streams(self) -> bool:
        return self.source == STREAM

    @property
    def reads_cache(self) -> bool:
        """Training reads the activation cache (layerwise) or the cached tokens (direct)."""
        return self.source == CACHE


def train_plan(cfg: RunConfig, source: str) -> TrainPlan:
    """The run's :class:`TrainPlan` once ``source`` is chosen (``cache``, ``stream`` or ``none``); the
    only place the mode, the source and the token counts are worked out."""
    require(source in (CACHE, STREAM, NO_SOURCE), f"a run trains from cache or stream (or none), not {source!r}")
    n, seq_len = cfg.data.num_tokens, cfg.data.seq_len
    streams = source == STREAM
    cached = min(n, sampled_tokens(cfg)) if streams else n
    packed = math.ceil(cached / seq_len) * seq_len
    # distill reads after every token the layerwise stage read; without a train stage, what it would read
    after_stream = source == STREAM or (source == NO_SOURCE and cfg.train.source == STREAM)
    offset = cfg.distill.offset if cfg.distill.offset is not None else \
        (min(n, sampled_tokens(cfg)) + n if after_stream else n)
    ledger = TokenLedger(cached=cached, streamed=n if streams else 0, skipped=packed if streams else 0,
                         kl_offset=offset, kl_tokens=cfg.distill.tokens if cfg.distill.name != "none" else 0,
                         heldout=cfg.data.heldout_tokens)
    return TrainPlan(training_mode(cfg), source, ledger)


def sampled_tokens(cfg: RunConfig) -> int:
    """The stream's cached sample before it is capped at ``data.num_tokens``: ``data.cache_tokens``,
    default 8,192."""
    return cfg.data.cache_tokens or STREAM_CACHE_TOKENS


def reserved_tokens(cfg: RunConfig, total: int) -> tuple[int, int]:
    """(cached sample, distill's tokens) that ``data.num_tokens=all`` leaves out of a prepared split of
    ``total`` tokens, before the source is chosen: a run that may stream keeps its sample out."""
    sample = 0 if cfg.train.source == CACHE else min(total, sampled_tokens(cfg))
    reserved = cfg.distill.tokens if cfg.distill.name != "none" and cfg.distill.offset is None else 0
    return sample, reserved


def distill_schedule(cfg: RunConfig, batch_tokens: int) -> DistillSchedule:
    """The KL trainer's schedule: ``distill.tokens`` in steps of the effective batch."""
    d = cfg.distill
    return DistillSchedule(steps=max(1, d.tokens // batch_tokens), micro_batch_size=d.micro_batch_size or d.batch_size,
                           lr=d.lr, feature_lr=d.feature_lr, scale_lr=d.scale_lr, temperature=d.temperature,
                           warmup_steps=d.warmup_steps, schedule=d.schedule, grad_clip=d.grad_clip, log_every=d.log_every,
                           checkpoint_every=d.checkpoint_every, precision=cfg.precision,
                           window_dropout=d.window_dropout, window_dropout_end=d.window_dropout_end, seed=cfg.seed,
                           logit_chunk=d.logit_chunk, teacher_topk=d.teacher_topk)
