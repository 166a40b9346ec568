"""The hybrid student with its linear part removed (``eval.ablate_linear``): what the linear part adds
to the full student's perplexity and attention error (:func:`dofla.eval.probes.ablation_metrics`)."""
from __future__ import annotations

from dofla.eval import probes
from dofla.eval.measures.base import Measurement, register
from dofla.eval.store import tokens_digest


def heldout_settings(run) -> dict:
    """The held-out settings the ablation and the window mass share."""
    ev = run.cfg.eval
    return {"heldout": tokens_digest(run.heldout), "batch_size": ev.batch_size, "attn_error_seqs": ev.attn_error_seqs}


def settings(run, who) -> dict:
    ev = run.cfg.eval
    return {"student": run.who_settings["student"], "teacher": run.who_settings["teacher"], **heldout_settings(run),
            "perplexity": ev.perplexity, "attention_error": ev.attention_error}


def compute(run, who, model) -> dict:
    return probes.ablation_metrics(run.cfg, run.teacher, run.student, run.heldout, run.metrics)


register(Measurement("ablate_linear", ("ablate/", "seq/ablate/"),
                     lambda cfg: cfg.eval.ablate_linear, settings, compute, models=()))
