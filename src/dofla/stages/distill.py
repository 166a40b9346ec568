"""The distill stage (``distill=kl``): the assembled student trained on KL(teacher ‖ student) over
fresh streamed text -> ``student_distilled/``, reused only for the same settings; checkpointed
(``distill_ckpt.pt``), so a killed run resumes where it stopped. Under torchrun every rank trains on
its share of each batch (:func:`dofla.train.distill.train_kl`) and rank 0 writes."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dofla import distributed
from dofla.artifacts import canonical, model_dir_matches, save_model_dir
from dofla.cache.teacher_logits import TeacherLogitCache, entry_bytes
from dofla.data.copies import CopySpans
from dofla.errors import require
from dofla.models.student import load_student
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import distill_settings, teacher_settings
from dofla.stages.plan import distill_schedule
from dofla.stages.sources import cache_root, data_source, training_stream
from dofla.stages.students import with_settings
from dofla.train.distill import teacher_targets, train_kl

logger = logging.getLogger(__name__)

TARGET = "student_distilled"


@dataclass(frozen=True)
class Distilled:
    """The distill stage's result: the student and the distillation tokens it was trained on."""

    student: Any
    tokens: int


def run(ctx: RunContext, student, data: RunData, tracker=None) -> Distilled:
    """The distilled student (or the stored one, for the same settings); ``tracker`` gets the KL
    every ``distill.log_every`` steps while it trains."""
    cfg, target = ctx.cfg, ctx.out_dir / TARGET
    settings = distill_settings(cfg, getattr(student, "dofla_settings", None))
    device = next(student.parameters()).device
    summary = read_json(ctx.out_dir / "distill_summary.json") or {}
    if model_dir_matches(target, settings) and summary.get("settings") == canonical(settings):
        return Distilled(with_settings(load_student(target).to(device), settings), summary["tokens"])
    d = cfg.distill
    stream = training_stream(cfg, ctx.tokenizer, d.batch_size, offset(ctx, data), seq_len=d.seq_len,
                             source=data_source(ctx), passes=d.passes)
    if d.copy_share:
        stream = CopySpans(stream, d.copy_share, d.copy_distance, cfg.seed)
    log = None if tracker is None else (lambda values: tracker.log(values))
    s = distill_schedule(ctx.cfg, stream.batch_tokens)
    cache = teacher_logit_cache(ctx, s, stream.seq_len, s.steps * d.batch_size)
    targets_of = None if cache is None else (lambda rows: cache.targets(rows, lambda m: teacher_targets(ctx.teacher, m, s)))
    student, curve, tokens = train_kl(student, ctx.teacher, stream, d.train, s,
                                      checkpoint_path=ctx.out_dir / "distill_ckpt.pt", meta=settings,
                                      lora=(d.lora_rank, d.lora_alpha), on_log=log, data_parallel=True,
                                      targets_of=targets_of)
    if cache is not None:
        logger.info(f"dofla: teacher-logit cache {cache.dir}: {cache.hits} rows read, {cache.misses} computed")
    if distributed.is_main():  # every rank holds the same student
        write_json(ctx.out_dir / "distill_summary.json", {"tokens": tokens, "curve": curve, "settings": settings})
        save_model_dir(student, ctx.tokenizer, target, settings)
        (ctx.out_dir / "distill_ckpt.pt").unlink(missing_ok=True)  # the student directory supersedes it
    distributed.barrier()
    return Distilled(with_settings(student, settings), tokens)


def teacher_logit_cache(ctx: RunContext, s, seq_len: int, rows: int):
    """The store of the teacher's targets for this run's text (``distill.teacher_cache``), or None: off,
    exact targets in logit chunks (never whole, so never stored), or a text too large for
    ``distill.teacher_cache_gb`` (said in one sentence)."""
    cfg, d, teacher = ctx.cfg, ctx.cfg.distill, ctx.teacher
    vocab = teacher.get_output_embeddings().weight.shape[0]
    require(d.teacher_topk < vocab, f"distill.teacher_topk={d.teacher_topk} must be less than the teacher's "
            f"vocabulary of {vocab} tokens; 0 keeps the whole distribution")
    if d.teacher_cache == "off":
        return None
    if s.logit_chunk and not s.teacher_topk:
        logger.warning("dofla: distill.teacher_cache: exact targets with distill.logit_chunk are never whole logits and are "
              "not stored; set distill.teacher_topk to store the text's targets")
        return None
    param = next(teacher.parameters())
    half = cfg.precision == "bf16" or param.dtype != torch.float32
    need, limit = rows * entry_bytes(seq_len, vocab, d.teacher_topk, 2 if half else 4), d.teacher_cache_gb * 2**30
    if need > limit:
        logger.warning(f"dofla: distill.teacher_cache: this text's teacher targets need {need / 2**20:,.1f} MiB, more than "
              f"distill.teacher_cache_gb={d.teacher_cache_gb:g}; they are not stored (raise the limit or set "
              "distill.teacher_topk)")
        return None
    fields = {"teacher": teacher_settings(cfg), "dtype": str(param.dtype), "precision": cfg.precision,
              "device": param.device.type, "format": f"top{d.teacher_topk}" if d.teacher_topk else "exact"}
    if d.teacher_topk:  # the stored log-probabilities are at this temperature; exact logits are not
        fields["temperature"] = d.temperature
    return TeacherLogitCache(cache_root(cfg) / "teacher_logits", fields, int(limit))


def offset(ctx: RunContext, data: RunData) -> int:
    """Tokens of the training text skipped first: ``distill.offset``, else every token the layerwise
    stage read (its cache, or its cached sample plus its stream), so distillation sees fresh text
    (the run's token ledger, :class:`~dofla.stages.plan.TokenLedger`)."""
    return ctx.train.ledger.kl_offset

