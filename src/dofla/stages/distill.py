"""The distill stage (``distill=kl``): the assembled student trained on KL(teacher ‖ student) over
fresh streamed text -> ``student_distilled/``, reused only for the same settings; checkpointed
(``distill_ckpt.pt``), so a killed run resumes where it stopped. Under torchrun every rank trains on
its share of each batch (:func:`dofla.train.distill.train_kl`) and rank 0 writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dofla import distributed
from dofla.artifacts import canonical
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import distill_settings
from dofla.stages.sources import data_source, training_stream
from dofla.stages.students import with_settings

TARGET = "student_distilled"


@dataclass(frozen=True)
class Distilled:
    """The distill stage's result: the student and the distillation tokens it was trained on."""

    student: Any
    tokens: int


def run(ctx: RunContext, student, data: RunData, tracker=None) -> Distilled:
    """The distilled student (or the stored one, for the same settings); ``tracker`` gets the KL
    every ``distill.log_every`` steps while it trains."""
    from dofla.artifacts import model_dir_matches, save_model_dir
    from dofla.models import load_student
    from dofla.train.distill import train_kl

    cfg, target = ctx.cfg, ctx.out_dir / TARGET
    settings = distill_settings(cfg, getattr(student, "dofla_settings", None))
    device = next(student.parameters()).device
    summary = read_json(ctx.out_dir / "distill_summary.json") or {}
    if model_dir_matches(target, settings) and summary.get("settings") == canonical(settings):
        return Distilled(with_settings(load_student(target).to(device), settings), summary["tokens"])
    d = cfg.distill
    stream = training_stream(cfg, ctx.tokenizer, d.batch_size, offset(ctx, data), seq_len=d.seq_len,
                             source=data_source(ctx))
    if d.copy_share:
        from dofla.data.copies import CopySpans

        stream = CopySpans(stream, d.copy_share, d.copy_distance, cfg.seed)
    log = None if tracker is None else (lambda values: tracker.log(values))
    student, curve, tokens = train_kl(student, ctx.teacher, stream, d.train, schedule(ctx, stream.batch_tokens),
                                      checkpoint_path=ctx.out_dir / "distill_ckpt.pt", meta=settings,
                                      lora=(d.lora_rank, d.lora_alpha), on_log=log, data_parallel=True)
    if distributed.is_main():  # every rank holds the same student
        write_json(ctx.out_dir / "distill_summary.json", {"tokens": tokens, "curve": curve, "settings": settings})
        save_model_dir(student, ctx.tokenizer, target, settings)
        (ctx.out_dir / "distill_ckpt.pt").unlink(missing_ok=True)  # the student directory supersedes it
    distributed.barrier()
    return Distilled(with_settings(student, settings), tokens)


def schedule(ctx: RunContext, batch_tokens: int):
    """The trainer's schedule: ``distill.tokens`` in steps of the effective batch."""
    from dofla.train.distill import DistillSchedule

    d = ctx.cfg.distill
    return DistillSchedule(steps=max(1, d.tokens // batch_tokens), micro_batch_size=d.micro_batch_size or d.batch_size,
                           lr=d.lr, feature_lr=d.feature_lr, scale_lr=d.scale_lr, temperature=d.temperature,
                           warmup_steps=d.warmup_steps, schedule=d.schedule, grad_clip=d.grad_clip, log_every=d.log_every,
                           checkpoint_every=d.checkpoint_every, precision=ctx.cfg.precision,
                           window_dropout=d.window_dropout, window_dropout_end=d.window_dropout_end, seed=ctx.cfg.seed,
                           logit_chunk=d.logit_chunk)


def offset(ctx: RunContext, data: RunData) -> int:
    """Tokens of the training text skipped first: ``distill.offset``, else every token the layerwise
    stage read (its cache, or its cached sample plus its stream), so distillation sees fresh text
    (the run's token ledger, :class:`~dofla.stages.plan.TokenLedger`)."""
    return ctx.train.ledger.kl_offset

