"""The eval section's value checks (dofla.eval.checks, run by validate_config and validate_against_model):
generation agreement's settings fail before any model loads, with one sentence naming the key."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dofla.config import RunConfig
from dofla.eval.agreement import agreement_prompts
from dofla.eval.checks import agreement_prompts_available
from dofla.validate import ConfigError, validate_against_model, validate_config


def with_eval(**changes) -> RunConfig:
    base = RunConfig()
    return dataclasses.replace(base, eval=dataclasses.replace(base.eval, **changes))


@pytest.mark.parametrize(("changes", "key"), [
    ({"agreement_prompts": -1}, r"eval.agreement_prompts=-1 must be 0 \(off\)"),
    ({"agreement_prompts": 4, "agreement_prompt_len": 0}, "eval.agreement_prompt_len=0"),
    ({"agreement_prompts": 4, "agreement_tokens": 0}, "eval.agreement_tokens=0"),
    ({"agreement_prompts": 65}, r"eval.agreement_prompts=65 asks for more prompts .* \(64\)"),
    ({"agreement_prompts": 1, "agreement_prompt_len": 1024}, r"than the held-out text gives \(0\)"),
])
def test_bad_agreement_settings_fail_before_any_model(changes, key):
    with pytest.raises(ConfigError, match=key):
        validate_config(with_eval(**changes))


def test_agreement_off_by_default_and_on_within_the_held_out_text():
    validate_config(RunConfig())
    validate_config(with_eval(agreement_prompts=64))  # 8 held-out sequences of 512 tokens, 8 prompts each


def test_prompt_and_continuation_must_fit_the_models_context():
    cfg = with_eval(agreement_prompts=4, agreement_prompt_len=64, agreement_tokens=32)
    validate_against_model(cfg, num_layers=2, head_dim=16, max_positions=512)
    with pytest.raises(ConfigError, match="96 tokens exceed the model's context of 80"):
        validate_against_model(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=64)),
                               num_layers=2, head_dim=16, max_positions=80)


@pytest.mark.parametrize(("heldout", "seq_len", "prompt_len"), [(4096, 512, 64), (1000, 300, 7), (64, 64, 64)])
def test_the_count_checked_is_the_count_the_prompts_give(heldout, seq_len, prompt_len):
    base = RunConfig()
    cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, heldout_tokens=heldout, seq_len=seq_len),
                              eval=dataclasses.replace(base.eval, agreement_prompt_len=prompt_len))
    sequences = -(-heldout // seq_len)  # the held-out split is packed into ceil(tokens / seq_len) sequences
    available = agreement_prompts_available(cfg)
    assert agreement_prompts(torch.zeros(sequences, seq_len), available, prompt_len).shape == (available, prompt_len)
    with pytest.raises(ConfigError):
        agreement_prompts(torch.zeros(sequences, seq_len), available + 1, prompt_len)
