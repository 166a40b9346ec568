"""Decode memory per sequence at ``eval.memory_contexts`` (:mod:`dofla.eval.memory`)."""
from __future__ import annotations

from dofla.eval.measures.base import Measurement, register
from dofla.eval.memory import memory_metrics


def settings(run, who) -> dict:
    return {"model": run.who_settings[who], "contexts": run.cfg.eval.memory_contexts}


def compute(run, who, model) -> dict:
    return memory_metrics(who, model, run.cfg.eval.memory_contexts)


register(Measurement("memory", ("memory/",),
                     lambda cfg: bool(cfg.eval.memory_contexts), settings, compute, shared=True))
