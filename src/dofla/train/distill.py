"""Model-level distillation: KL(teacher ‖ student) on next-token distributions (``distill=kl``).

The layerwise stage matches each layer's attention on its own; errors then compound through the
network. This stage trains the whole assembled student to reproduce the teacher's next-token
distribution, on fresh streamed text, so the layers adapt to each other's errors (the recipe of
the strongest published conversions: short attention alignment, then most tokens on KL).

What trains is named by the config: ``features`` (every layer's feature map), ``attention`` (the
attention projections, fully), ``lora`` (low-rank adapters on them, merged on return), ``gate``
(the decay gates of a gated student, at the feature maps' rate); a hybrid's learned linear scale
trains with the features, at its own rate. Everything else is frozen. The
teacher's targets are computed on the fly, or read from a store of them (``distill.teacher_cache``:
:mod:`dofla.cache.teacher_logits`), in the format ``distill.teacher_topk`` names
(:mod:`dofla.train.kl_targets`). Batches are micro-batched
(gradient accumulation), so the effective batch does not set the peak memory. Under torchrun
(``data_parallel``) every rank reads the same batches, runs teacher and student on its own rows of
each, and the gradients are averaged before clipping: the single-process step at the same batch.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dofla import distributed
from dofla.attention.gate import project_gates
from dofla.data.stream import StreamExhausted
from dofla.models.mixed_attention import hybrid_attentions
from dofla.precision import autocast
from dofla.train.kl_targets import ExactTargets, HeadTargets, Targets, TopKTargets, topk_targets
from dofla.train.logit_chunks import body_and_head, check_head, chunked_kl_backward
from dofla.train.checkpoints import one_unit_checkpoint
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, run_loop
from dofla.train.step import micro_batches
from dofla.train.trainable import (  # noqa: F401 - API: what trains, chosen by name
    TRAINABLE, attention_projections, feature_parameters, finish, gate_parameters, prepare_trainable,
    scale_parameters,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class DistillSchedule:
    """How the distillation steps run (the stage builds it from ``DistillConfig``)."""

    steps: int
    micro_batch_size: int
    lr: float  # attention projections / LoRA
    feature_lr: float  # feature maps
    scale_lr: float = 0.1  # a hybrid's learned linear scale
    temperature: float = 1.0
    warmup_steps: int = 0
    schedule: str = "cosine"  # constant | cosine (to 10 % of the peak, after warm-up)
    grad_clip: float = 1.0  # 0: none
    log_every: int = 10  # host synchronisations (loss to Python) only this often
    checkpoint_every: int = 50
    precision: str = "fp32"  # fp32 | tf32 | bf16 (the forwards under autocast; dofla.precision)
    window_dropout: float = 0.0  # hybrid layers: probability of running without window and sinks
    window_dropout_end: float | None = None  # linear schedule to this by the last step (None: constant)
    seed: int = 0  # which layers drop their window at each step
    logit_chunk: int = 0  # positions per LM-head chunk of the KL (0: the whole sequence; dofla.train.logit_chunks)
    teacher_topk: int = 0  # the targets: 0 the whole distribution, k > 0 the top k and the rest (kl_targets)


def window_dropout_rate(step: int, s: DistillSchedule) -> float:
    """The probability that a hybrid layer drops its window at ``step``: ``window_dropout``, moving
    linearly to ``window_dropout_end`` (when set) by the last step."""
    end = s.window_dropout if s.window_dropout_end is None else s.window_dropout_end
    return s.window_dropout + (end - s.window_dropout) * step / max(1, s.steps - 1)


def dropped_windows(num_hybrid: int, step: int, s: DistillSchedule) -> list[int]:
    """Which of the student's ``num_hybrid`` hybrid layers run without their window at ``step``, each
    independently with :func:`window_dropout_rate`. Drawn from (seed, step) alone, so a resumed run
    and every torchrun rank draw the same layers."""
    rate = window_dropout_rate(step, s)
    if rate <= 0 or num_hybrid == 0:
        return []
    draw = torch.rand(num_hybrid, generator=torch.Generator().manual_seed(s.seed * 1_000_003 + step))
    return [i for i in range(num_hybrid) if draw[i] < rate]


@contextmanager
def windows_dropped(student, layers: list[int]):
    """Inside the block, the hybrid layers ``layers`` (indices among the student's hybrid layers) run
    as pure linear attention: no exact window, no sinks, so their linear part must carry every key."""
    hybrid = hybrid_attentions(student)
    chosen = [hybrid[i] for i in layers]
    saved = [(attn.window, attn.sinks) for attn in chosen]
    try:
        for attn in chosen:
            attn.window, attn.sinks = 0, 0
        yield chosen
    finally:
        for attn, (window, sinks) in zip(chosen, saved):
            attn.window, attn.sinks = window, sinks


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of T² · KL(softmax(teacher / T) ‖ softmax(student / T)), in fp32.

    Logits (..., V); ``mask`` (...) bool selects the tokens that count (None: all). T² keeps the
    gradient's scale independent of the temperature (Hinton et al.).
    """
    log_p = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    if mask is not None:
        per_token = per_token[mask]
    return per_token.mean() * temperature**2


def kl_reference(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The same quantity through ``torch.nn.functional.kl_div`` (the plain reference of the tests)."""
    V = student_logits.shape[-1]
    log_q = torch.log_softmax(student_logits.double().reshape(-1, V) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.double().reshape(-1, V) / temperature, dim=-1)
    return nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2


def teacher_targets(teacher, ids: torch.Tensor, s: DistillSchedule) -> Targets:
    """The teacher's targets for ``ids`` (B, L) in the format ``s.teacher_topk`` names
    (:mod:`dofla.train.kl_targets`). With ``s.logit_chunk`` the teacher's logits are never whole: exact
    targets are its hidden states and head, top-k ones are made a chunk of positions at a time."""
    with torch.no_grad(), autocast(s.precision, ids.device):
        if not s.logit_chunk:
            logits = teacher(input_ids=ids, use_cache=False).logits
            return ExactTargets(logits) if not s.teacher_topk else topk_targets(logits, s.teacher_topk, s.temperature)
        body, head = body_and_head(teacher)
        hidden = body(ids)
        if not s.teacher_topk:
            return HeadTargets(hidden, head)
        parts = [topk_targets(head(hidden[:, i:i + s.logit_chunk]), s.teacher_topk, s.temperature)
                 for i in range(0, ids.shape[1], s.logit_chunk)]
        return TopKTargets(*(torch.cat([getattr(p, name) for p in parts], dim=1) for name in TopKTargets.FIELDS))


def kl_backward(model, ids: torch.Tensor, targets: Targets, s: DistillSchedule, weight: float = 1.0) -> torch.Tensor:
    """The student's forward on ``ids``, its KL to ``targets`` and ``weight`` × its backward (the
    KL step without the teacher). Returns the KL, detached."""
    if s.logit_chunk:
        return chunked_kl_backward(model, ids, targets, s.logit_chunk, s.temperature, s.precision, weight)
    with autocast(s.precision, ids.device):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = targets.kl(logits, s.temperature)  # in float32 whatever the logits' dtype
    (loss * weight).backward()
    return loss.detach()


def accumulate(model, teacher, batch: torch.Tensor, s: DistillSchedule,
               targets_of: Callable[[torch.Tensor], Targets] | None = None) -> torch.Tensor:
    """Forward/backward of one effective batch in micro-batches; the gradients are the full batch's
    (each micro-batch's mean KL weighted by its share of the rows). ``targets_of(rows)``: the teacher's
    targets (None: ``teacher`` runs, :func:`teacher_targets`; else e.g. a teacher-logit cache's).
    Returns the batch's KL (a tensor: no host synchronisation)."""
    total = torch.zeros((), device=batch.device)
    for micro, share in micro_batches(batch, s):
        targets = teacher_targets(teacher, micro, s) if targets_of is None else targets_of(micro)
        targets = targets.prepared(s.temperature)  # exact logits give way to the probabilities before the student runs
        total += kl_backward(model, micro, targets, s, share) * share
    return total


class Distillation(Trainer):
    """The KL stage on the loop harness (:func:`dofla.train.loop.run_loop`): one unit, everything
    ``train`` names in the student; each micro-batch the teacher's targets, then the student's forward,
    KL and backward (in chunks with ``logit_chunk``); a step runs with some hybrid windows dropped
    and ends with the gates projected back to decay."""

    kill, log_prefix, own_backward = "distill:step", "distill", True

    def __init__(self, model, student, teacher, batches, named, s: DistillSchedule, split: bool, targets_of=None):
        rates = {"features": s.feature_lr, "scale": s.scale_lr, "gate": s.feature_lr, "attention": s.lr, "lora": s.lr}
        optimizer = torch.optim.AdamW([{"params": p, "lr": rates[n], "name": n} for n, p in named], weight_decay=0.0)
        names = {n for n, p in model.named_parameters() if p.requires_grad}  # what a checkpoint keeps
        self.units = {"student": Unit(model, optimizer, keep=names.__contains__)}
        self.model, self.student, self.teacher, self.batches, self.s = model, student, teacher, batches, s
        self.split, self.targets_of, self.batch_tokens = split, targets_of, batches.batch_tokens
        self.device = next(student.parameters()).device
        self.num_hybrid = len(hybrid_attentions(student))
        self.used, self.checked = 0, False

    def next_batch(self, step: int) -> torch.Tensor | None:
        try:
            batch = self.batches.next_batch().to(self.device)
        except StreamExhausted:
            logger.warning(f"dofla: the data ran out after {self.used:,} distillation tokens ({step} of {self.s.steps} "
                  "steps); the stage ends here and records the tokens used")
            return None
        if self.s.logit_chunk and not self.checked:  # the chunked head must be the model's own
            check_head(self.model, batch)
            self.checked = True
        self.used += batch.numel()
        return distributed.my_rows(batch) if self.split else batch

    def step_context(self, step: int):
        return windows_dropped(self.student, dropped_windows(self.num_hybrid, step, self.s))

    def backward(self, key, rows: torch.Tensor, weight: float) -> torch.Tensor:
        s = self.s
        targets = teacher_targets(self.teacher, rows, s) if self.targets_of is None else self.targets_of(rows)
        targets = targets.prepared(s.temperature)  # exact logits give way to the probabilities before the student runs
        return kl_backward(self.model, rows, targets, s, weight)

    def after_step(self) -> None:
        project_gates(self.student)  # a gate's α stays ≥ 0: it decays, never amplifies

    def data_state(self):
        return {"batches": self.batches.state(), "used": self.used}

    def restore_data(self, state) -> None:
        self.batches.restore(state["batches"])
        self.used = state["used"]

    def log_values(self, curves) -> dict:
        return {"kl": curves["student"][-1]["loss"]}

    def message(self, key, step: int) -> str:
        return f"distill: non-finite KL at step {step}"


def legacy_checkpoint(saved: dict) -> dict:
    """A KL checkpoint written before the stage ran on the loop harness, in the loop's layout."""
    curve = [{"step": e["step"], "loss": e["kl"]} for e in saved["curve"]]
    return one_unit_checkpoint(saved["meta"], "student", saved["model"], saved["optimizer"], saved["step"], 0.0,
                               {"batches": saved["data"], "used": saved["tokens"]}, torch.get_rng_state(), curve)


def train_kl(student, teacher, batches, train: list[str], s: DistillSchedule, checkpoint_path: Path | None = None,
             meta: dict | None = None, lora: tuple[int, int] = (8, 16),
             on_log: Callable[[dict], None] | None = None, data_parallel: bool = False, progress: bool = True,
             targets_of: Callable[[torch.Tensor], Targets] | None = None):
    """Distil ``teacher`` into ``student`` for ``s.steps`` batches of ``batches`` (a ``BatchStream``-like
    source: ``next_batch()``, ``state()``, ``restore()``, ``batch_tokens``).

    Returns (the trained student, the curve, the tokens trained on). Resumes from ``checkpoint_path``
    when it was written with ``meta``. A source that runs out ends the stage early, saying so; the
    tokens returned are the ones actually used. ``progress=False`` hides the bar (the memory preflight's
    probe steps). ``targets_of(rows)``: the teacher's targets for token rows (None: ``teacher`` runs on
    every batch; :class:`dofla.cache.TeacherLogitCache` gives them once per text). ``data_parallel``:
    torchrun's ranks share every batch (each its rows ``rank::world``; every rank must call this alike;
    rank 0 writes the checkpoint and the KL logged is the batch's, the mean over the ranks). A step
    whose KL or gradients are not finite is skipped (its curve entry says so). The loop is
    :func:`dofla.train.loop.run_loop`'s.
    """
    split = data_parallel and distributed.world() > 1
    model, named = prepare_trainable(student, train, *lora)
    model.eval()  # dropout off: the target is the teacher's deterministic distribution
    teacher.eval()
    trainer = Distillation(model, student, teacher, batches, named, s, split, targets_of)
    loop = LoopConfig.of(s, eval_every=0, skip_nonfinite=True, lr_floor=0.1)
    done = run_loop(trainer, loop, Checkpointing(checkpoint_path, meta, legacy=legacy_checkpoint), on_log,
                    data_parallel=split, desc="distill (KL)", progress=progress)
    curve = [{"step": e["step"], "kl": e["loss"], **({"skipped": True} if e.get("skipped") else {})}
             for e in done.records["student"]["curve"]]
    return finish(model, student), curve, trainer.used
