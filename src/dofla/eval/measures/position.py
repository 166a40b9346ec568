"""Loss by position on long held-out sequences (``eval.position_buckets``)."""
from __future__ import annotations

from dofla.eval import probes
from dofla.eval.measures.base import Measurement, register
from dofla.eval.store import tokens_digest


def long_tokens(run):
    """The long held-out sequences, read once per run."""
    return run.once("long_tokens", lambda: probes.long_tokens(run.cfg, run.tokenizer, run.open_source()))


def settings(run, who) -> dict:
    return {"model": run.who_settings[who], "tokens": tokens_digest(long_tokens(run)),
            "edges": run.cfg.eval.position_buckets}


def compute(run, who, model) -> dict:
    return probes.position_metrics(run.cfg, who, model, long_tokens(run))


register(Measurement("position", ("position/", "seq/position/"),
                     lambda cfg: bool(cfg.eval.position_buckets), settings, compute, shared=True))
