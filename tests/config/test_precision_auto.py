"""``precision=auto``: the paper experiments pick tf32 where the run's device is a GPU and fp32 on the
CPU, say which, and an explicit precision on the command line still wins."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.pipeline import resolve_precision
from dofla.precision import resolve
from dofla.validate import ConfigError, validate_config


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize("experiment", ["paper_gpt2", "paper_pythia1b"])
def test_the_paper_experiments_resolve_auto_to_fp32_on_the_cpu_and_say_so(experiment, capsys):
    cfg = _compose([f"experiment={experiment}", "+variant=fix_softmax", "device=cpu"])
    validate_config(cfg)
    assert cfg.precision == "auto" and cfg.eval.finetune_micro_batch_size == "auto"
    assert cfg.eval.finetune_checkpoint_every > 0
    assert resolve_precision(cfg).precision == "fp32"
    assert "dofla: precision=auto: fp32 on the CPU" in capsys.readouterr().out


def test_an_explicit_precision_wins_and_a_run_without_auto_is_untouched(capsys):
    cfg = _compose(["experiment=paper_gpt2", "+variant=fix_softmax", "precision=bf16"])
    assert resolve_precision(cfg) is cfg and cfg.precision == "bf16"
    assert capsys.readouterr().out == ""


def test_auto_is_tf32_exactly_where_the_device_is_a_gpu():
    assert resolve("auto", "cpu") == "fp32"
    assert resolve("auto", "cuda") == resolve("auto", "cuda:1") == "tf32"
    assert resolve("fp32", "cuda") == "fp32" and resolve("tf32", "cpu") == "tf32"


def test_an_unknown_precision_names_the_valid_ones():
    with pytest.raises(ConfigError, match="precision.*auto"):
        validate_config(_compose(["experiment=smoke_tiny", "precision=fp16"]))


@pytest.mark.parametrize("value, ok", [("null", True), ("auto", True), ("4", True), ("{default: 2, mmlu: 1}", True),
                                       ("0", False), ("{mmlu: -1}", False), ("big", False)])
def test_the_fine_tune_micro_batch_is_checked_before_loading(value, ok):
    cfg = _compose(["experiment=smoke_tiny", f"eval.finetune_micro_batch_size={value}"])
    if ok:
        validate_config(cfg)
    else:
        with pytest.raises(ConfigError, match="eval.finetune_micro_batch_size=.* must be null"):
            validate_config(cfg)
