"""Held-out loss and perplexity of each model (``eval.perplexity``), and their ratio; every rank takes part."""
from __future__ import annotations

import math

from dofla.eval.measures.base import Measurement, register
from dofla.eval.metrics import heldout_losses
from dofla.eval.store import tokens_digest
from dofla.faults import kill_point


def settings(run, who) -> dict:
    return {"model": run.who_settings[who], "heldout": tokens_digest(run.heldout), "batch_size": run.cfg.eval.batch_size}


def compute(run, who, model) -> dict:
    kill_point(f"eval:{who}")
    losses = heldout_losses(model, run.heldout, run.cfg.eval.batch_size, data_parallel=True)
    loss = losses.mean().item()
    return {f"eval/{who}_loss": loss, f"eval/{who}_ppl": math.exp(loss) if loss < 700 else float("inf"),
            f"seq/heldout/{who}": losses.tolist()}


def ratio(metrics: dict) -> dict:
    return {"eval/ppl_ratio": metrics["eval/student_ppl"] / metrics["eval/teacher_ppl"]}


register(Measurement("perplexity", ("eval/teacher_", "eval/student_", "eval/ppl_ratio", "seq/heldout/"),
                     lambda cfg: cfg.eval.perplexity, settings, compute, shared=True, every_rank=True,
                     combine=ratio))
