"""The registered measurements key their stored results exactly as the eval stage keyed them before
they were registered (``tests/fixtures/measurement_keys.json`` holds those keys, computed with the
stage's earlier formulas on the inputs below): stored measurements and committed records stay valid."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dofla.artifacts import settings_digest
from dofla.config import RunConfig
from dofla.eval.measures import MEASURES, EvalRun, enabled
from dofla.eval.measures.base import check_writes, stored_name
from dofla.registry import UnknownNameError

KEYS = json.loads((Path(__file__).parents[1] / "fixtures" / "measurement_keys.json").read_text())
ORDER = ["perplexity", "attention", "ablate_linear", "window_mass", "memory", "position", "passkey", "mqar",
         "agreement"]


def every_probe(**eval_changes) -> RunConfig:
    base = RunConfig()
    ev = dataclasses.replace(base.eval, ablate_linear=True, window_mass=True, memory_contexts=[64, 128],
                             position_buckets=[0, 8, 16], passkey_lengths=[32, 48], mqar=True, batch_size=3,
                             attn_error_seqs=2, **eval_changes)
    return dataclasses.replace(base, eval=ev, seed=5,
                               attention=dataclasses.replace(base.attention, name="hybrid", window=8, sinks=2))


def eval_run(cfg: RunConfig) -> EvalRun:
    run = EvalRun(cfg, None, None, {"teacher": {"settings": {"teacher": 1}}, "student": {"weights": "abc"}},
                  torch.arange(4 * 16).reshape(4, 16))
    run.once("long_tokens", lambda: torch.arange(2 * 32).reshape(2, 32) + 7)
    return run


def keys_of(run: EvalRun) -> dict:
    return {stored_name(m, who): f"{stored_name(m, who)}-{settings_digest(m.settings(run, who))}"
            for m in enabled(run.cfg, True) + enabled(run.cfg, False) for who in m.models or (None,)}


def test_every_probe_keys_its_result_as_before():
    assert keys_of(eval_run(every_probe())) == KEYS


def test_the_order_is_fixed_and_the_every_rank_ones_come_first():
    assert [m.name for m in MEASURES.in_order()] == ORDER
    assert [m.name for m in enabled(every_probe(), True)] == ["perplexity", "attention"]
    assert [m.name for m in enabled(every_probe(agreement_prompts=2), False)] == ORDER[2:]


def test_the_default_eval_takes_what_it_took_before_and_agreement_is_off():
    default = RunConfig()
    assert [m.name for m in enabled(default, True) + enabled(default, False)] == ["perplexity", "attention"]


def test_agreement_is_keyed_by_both_models_the_prompts_and_the_length():
    run = eval_run(every_probe(agreement_prompts=4, agreement_prompt_len=8))
    key = MEASURES.get("agreement").settings(run, None)
    assert set(key) == {"teacher", "student", "prompts", "new_tokens"} and key["new_tokens"] == 32
    other = eval_run(every_probe(agreement_prompts=4, agreement_prompt_len=4))
    assert MEASURES.get("agreement").settings(other, None)["prompts"] != key["prompts"]


def test_an_unknown_measurement_names_the_valid_ones():
    with pytest.raises(UnknownNameError, match="did you mean 'passkey'"):
        MEASURES.get("paskey")


def test_a_result_naming_what_its_registration_does_not_declare_is_refused():
    mqar = MEASURES.get("mqar")
    assert check_writes(mqar, {"mqar/student/T64": 0.5, "seq/mqar/student/T64": [1.0, 0.0]})
    with pytest.raises(ValueError, match="'mqar' wrote recall/student"):
        check_writes(mqar, {"mqar/student/T64": 0.5, "recall/student": 0.5})
