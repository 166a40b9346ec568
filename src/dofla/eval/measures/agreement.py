"""Generation-scored agreement of the student's greedy continuations with the teacher's
(``eval.agreement_prompts`` > 0; :mod:`dofla.eval.agreement`)."""
from __future__ import annotations

from dofla.eval.agreement import agreement_metrics, agreement_prompts
from dofla.eval.measures.base import Measurement, register
from dofla.eval.store import tokens_digest


def _prompts(run):
    ev = run.cfg.eval
    return agreement_prompts(run.heldout, ev.agreement_prompts, ev.agreement_prompt_len)


def settings(run, who) -> dict:
    return {"teacher": run.who_settings["teacher"], "student": run.who_settings["student"],
            "prompts": tokens_digest(_prompts(run)), "new_tokens": run.cfg.eval.agreement_tokens}


def compute(run, who, model) -> dict:
    ev = run.cfg.eval
    return agreement_metrics(run.teacher, run.student, _prompts(run), ev.agreement_tokens, ev.batch_size)


register(Measurement("agreement", ("agreement/", "seq/agreement/"),
                     lambda cfg: cfg.eval.agreement_prompts > 0, settings, compute, models=()))
