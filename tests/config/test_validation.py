"""Bad config values fail before any model is loaded, with one sentence naming the key."""
from __future__ import annotations

import dataclasses

import pytest

from dofla.config import RunConfig
from dofla.validate import ConfigError, validate_against_model, validate_config, validate_output_dir


def _cfg(**changes) -> RunConfig:
    cfg = RunConfig()
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if key:
            setattr(getattr(cfg, section), key, value)
        else:
            setattr(cfg, section, value)
    return cfg


BAD_BEFORE_MODEL = [
    ({"feature_map__name": "performr"}, "feature_map.name"),
    ({"loss__name": "kl"}, "loss.name"),
    ({"allocation__policy": "dof_head_x"}, "allocation.policy"),
    ({"allocation__gram_norm": "frobenius"}, "allocation.gram_norm"),
    ({"data__name": "wikipedai"}, "data.name"),
    ({"train__schedule": "linear"}, "train.schedule"),
    ({"allocation__lam": 0.0}, "allocation.lam"),
    ({"allocation__lam": -1e-3}, "allocation.lam"),
    ({"allocation__num_samples": 0}, "allocation.num_samples"),
    ({"data__seq_len": 0}, "data.seq_len"),
    ({"data__num_tokens": -5}, "data.num_tokens"),
    ({"data__heldout_tokens": 0}, "data.heldout_tokens"),
    ({"budget__multiple": 0.0}, "budget.multiple"),
    ({"budget__value": -64}, "budget.value"),
    ({"train__batch_size": 0}, "train.batch_size"),
    ({"train__steps": -1}, "train.steps"),
    ({"train__lr_z": 0}, "train.lr_z"),
    ({"train__heldout_fraction": 1.0}, "train.heldout_fraction"),
    ({"train__checkpoint_every": 0}, "train.checkpoint_every"),
    ({"eval__batch_size": 0}, "eval.batch_size"),
    ({"attention__chunk_size": 0}, "attention.chunk_size"),
    ({"attention__window": -4}, "attention.window"),
    ({"finetune__name": "qlora"}, "finetune.name"),
    ({"finetune__rank": 0}, "finetune.rank"),
    ({"data__num_tokens": 100, "data__seq_len": 512}, "data.num_tokens"),
    ({"stages": ["cache", "trian"]}, "stages"),
    ({"logger__name": "tensorboard"}, "logger.name"),
]


@pytest.mark.parametrize("changes,key", BAD_BEFORE_MODEL, ids=[k for _, k in BAD_BEFORE_MODEL])
def test_bad_value_names_its_key(changes, key):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(**changes))
    message = str(err.value)
    assert key in message and "\n" not in message


BAD_FOR_MODEL = [
    ({"budget__value": 0.5}, "at least 1"),
    ({"allocation__policy": "dof_clip", "budget__multiple": 2.0}, "dof_clip"),
    ({"train__layers": [0, 30]}, "train.layers"),
    ({"train__layers": [-1]}, "train.layers"),
    ({"data__seq_len": 4096}, "data.seq_len"),
]


@pytest.mark.parametrize("changes,needle", BAD_FOR_MODEL, ids=[n for _, n in BAD_FOR_MODEL])
def test_bad_value_for_the_model_geometry(changes, needle):
    cfg = _cfg(**changes)
    validate_config(cfg)
    with pytest.raises(ConfigError) as err:
        validate_against_model(cfg, num_layers=30, head_dim=64, max_positions=2048)
    assert needle in str(err.value)


def test_good_defaults_pass():
    cfg = RunConfig()
    validate_config(cfg)
    validate_against_model(cfg, num_layers=30, head_dim=64, max_positions=2048)
    assert dataclasses.asdict(cfg)["allocation"]["policy"] == "dof"


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as err:
        validate_output_dir(blocker / "run")
    assert "output directory" in str(err.value)
