"""Per-layer relative error of the student's attention outputs against the teacher's, on the first
``eval.attn_error_seqs`` held-out sequences (``eval.attention_error``); every rank takes part."""
from __future__ import annotations

from dofla.eval.measures.base import Measurement, register
from dofla.eval.metrics import attention_errors
from dofla.eval.store import tokens_digest
from dofla.faults import kill_point


def _tokens(run):
    return run.heldout[: run.cfg.eval.attn_error_seqs]


def settings(run, who) -> dict:
    return {"teacher": run.who_settings["teacher"], "student": run.who_settings["student"],
            "tokens": tokens_digest(_tokens(run))}


def compute(run, who, model) -> dict:
    kill_point("eval:attention")
    errors = attention_errors(run.teacher, run.student, _tokens(run), data_parallel=True)
    out = {f"eval/attn_error/layer_{i:02d}": float(err) for i, err in enumerate(errors)}
    return {**out, "eval/attn_error/mean": float(sum(errors) / len(errors))}


register(Measurement("attention", ("eval/attn_error/",),
                     lambda cfg: cfg.eval.attention_error, settings, compute, models=(),
                     every_rank=True))
