"""Passkey retrieval accuracy and answer NLL per context length (``eval.passkey_lengths``)."""
from __future__ import annotations

from dofla.eval import probes
from dofla.eval.measures.base import Measurement, register


def settings(run, who) -> dict:
    return probes.passkey_settings(run.cfg, run.who_settings[who])


def compute(run, who, model) -> dict:
    return probes.passkey_metrics(run.cfg, who, model, run.tokenizer)


register(Measurement("passkey", ("passkey/", "passkey_nll/", "seq/passkey/", "seq/passkey_nll/"),
                     lambda cfg: bool(cfg.eval.passkey_lengths), settings, compute, shared=True))
