"""``stages`` on the tiny random Llama: what runs, what is written, what fails before the model loads."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.pipeline import run
from dofla.stages.report import log_allocation
from dofla.stages.results import DofResult
from dofla.tracking import NullTracker


class Recorder(NullTracker):
    """Keeps what the pipeline logs, so the test can read it back."""

    def __init__(self):
        self.scalars, self.tables = {}, {}

    def log(self, metrics: dict, step=None) -> None:
        self.scalars.update(metrics)

    def log_table(self, name: str, columns: list, rows: list) -> None:
        self.tables[name] = rows


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", f"paths.cache_dir={tmp_path / 'cache'}", *overrides]))


def test_fix_skips_algorithm1_unless_listed(tmp_path):
    tracker = Recorder()
    run(_cfg(tmp_path, "allocation=fix", "stages=[cache,allocate]"), tmp_path / "fix", tracker=tracker)
    allocation = json.loads((tmp_path / "fix" / "allocation.json").read_text())
    assert allocation["layer_dof"] is None and allocation["dims"] == [16, 16]
    assert not (tmp_path / "fix" / "dof.json").exists() and not (tmp_path / "fix" / "layers").exists()
    assert tracker.scalars["allocation/mean_dim"] == 16 and not any(k.startswith("dof/") for k in tracker.scalars)
    assert "dof_table" not in tracker.tables
    run_json = json.loads((tmp_path / "fix" / "run.json").read_text())
    assert run_json["stages"] == ["cache", "allocate"] and run_json["cache_key"]

    run(_cfg(tmp_path, "allocation=fix", "stages=[cache,dof,allocate]"), tmp_path / "fix_dof")
    allocation = json.loads((tmp_path / "fix_dof" / "allocation.json").read_text())
    dof = json.loads((tmp_path / "fix_dof" / "dof.json").read_text())
    assert allocation["dims"] == [16, 16] and allocation["layer_dof"] == dof["layer_dof"]


def test_given_dims_are_the_allocation_and_train_the_student_they_name(tmp_path):
    """allocation=given: the user's dims, Algorithm 1 skipped; the layers trained have those dims."""
    run(_cfg(tmp_path, "allocation=given", "allocation.dims=[24,8]", "stages=[cache,allocate,train,assemble]"),
        tmp_path / "given")
    allocation = json.loads((tmp_path / "given" / "allocation.json").read_text())
    assert allocation["dims"] == [24, 8] and allocation["mean_dim"] == 16 and allocation["layer_dof"] is None
    assert not (tmp_path / "given" / "dof.json").exists()
    student = json.loads((tmp_path / "given" / "student" / "config.json").read_text())
    assert student["dofla"]["dims"] == [24, 8]


def test_dof_policy_computes_the_stages_allocate_needs(tmp_path):
    run(_cfg(tmp_path, "allocation=dof", "stages=[allocate]"), tmp_path / "dof")
    allocation = json.loads((tmp_path / "dof" / "allocation.json").read_text())
    dof = json.loads((tmp_path / "dof" / "dof.json").read_text())
    assert allocation["layer_dof"] == dof["layer_dof"] and len(allocation["dims"]) == 2


def test_log_allocation_with_dof_logs_the_table():
    tracker = Recorder()
    log_allocation(tracker, DofResult.of({"layer_dof": [3.0, 5.0], "per_head": [[3.0, 3.0], [4.0, 6.0]]}), [8, [4, 12]])
    assert tracker.scalars["dof/layer_01"] == 5.0 and tracker.scalars["allocation/dim/layer_01"] == 8
    assert tracker.tables["dof_table"] == [[0, 0, 3.0, 8], [0, 1, 3.0, 8], [1, 0, 4.0, 4], [1, 1, 6.0, 12]]


@pytest.mark.parametrize("override,needle", [
    ("+feature_map.options.bogus=3", "feature_map.options.bogus is not an option of feature map 'learned_prf'"),
    ("stages=[eval]", "leaves out train, assemble"),
])
def test_bad_options_and_stages_fail_before_the_model_loads(tmp_path, override, needle):
    from dofla.validate import ConfigError

    cfg = _cfg(tmp_path, override, f"model.source={tmp_path / 'no_model'}")  # loading it would fail
    with pytest.raises(ConfigError, match=needle):
        run(cfg, tmp_path / "run")
