"""Multi-query associative recall: accuracy against sequence length (``eval.mqar``)."""
from __future__ import annotations

from dofla.eval import suite
from dofla.eval.measures.base import Measurement, register


def settings(run, who) -> dict:
    ev = run.cfg.eval
    return {"model": run.who_settings[who], "seq_lens": ev.mqar_seq_lens, "examples": ev.mqar_examples,
            "seed": run.cfg.seed}


def compute(run, who, model) -> dict:
    return suite.mqar(model, who, run.cfg.eval, run.cfg.seed)


register(Measurement("mqar", ("mqar/", "seq/mqar/"),
                     lambda cfg: cfg.eval.mqar, settings, compute))
