"""Resume is keyed by settings, never by file existence: jobs of other settings sharing a layer
directory keep each other's layers, a changed setting redoes what depends on it (and only that),
and assembling with a trained layer missing fails in one sentence."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dofla.config import FeatureMapConfig, ModelConfig, RunConfig, TrainConfig
from dofla.models import load_student
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from tests.conftest import reproducible, write_local_tasks
from tests.integration.test_pipeline import run_cli


def _args(run, cache, *extra):
    return ["experiment=smoke_tiny", f"hydra.run.dir={run}", f"paths.cache_dir={cache}", *extra]


def _metrics(run) -> dict:
    return reproducible(json.loads((run / "metrics.json").read_text()))


def _files(directory) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _features_equal(student_dir, layers_dir) -> bool:
    """The student's feature maps are exactly the layer artifacts in ``layers_dir``."""
    student = load_student(student_dir)
    for i, attn in enumerate(student.student_attentions()):
        saved = torch.load(layers_dir / f"layer_{i:02d}.pt", weights_only=False)["state_dict"]
        if not all(torch.equal(t, saved[n]) for n, t in attn.feature_map.state_dict().items()):
            return False
    return True


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("settings_base")
    result = run_cli(*_args(root / "run", root / "cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.long
def test_jobs_of_other_settings_sharing_layer_dir_keep_their_own_layers(base, tmp_path):
    shared, cache = tmp_path / "layers", base / "cache"
    first = run_cli(*_args(tmp_path / "a", cache, f"train.layer_dir={shared}"))
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(shared)
    second = run_cli(*_args(tmp_path / "b", cache, f"train.layer_dir={shared}", "train.steps=3"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "not usable" not in second.stdout + second.stderr
    subdirs = sorted(p for p in shared.iterdir() if p.is_dir())
    steps = {json.loads((d / "settings.json").read_text())["train"]["steps"]: d for d in subdirs}
    assert len(subdirs) == 2 and set(steps) == {6, 3}
    for d in subdirs:
        assert {p.name for p in d.glob("*.pt")} == {"layer_00.pt", "layer_01.pt"}
    after = _files(shared)
    assert all(after[name] == data for name, data in before.items())  # the first job's files untouched
    assert _features_equal(tmp_path / "a" / "student", steps[6])
    assert _features_equal(tmp_path / "b" / "student", steps[3])
    assert _metrics(tmp_path / "a")["eval/student_ppl"] != _metrics(tmp_path / "b")["eval/student_ppl"]
    metrics_a = _metrics(tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "student")
    again = run_cli(*_args(tmp_path / "a", cache, f"train.layer_dir={shared}"))  # reassembles, trains nothing
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(shared) == after
    assert _features_equal(tmp_path / "a" / "student", steps[6])
    assert _metrics(tmp_path / "a") == metrics_a


def test_changed_training_setting_in_the_same_run_dir_redoes_what_depends_on_it(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    result = run_cli(*_args(run, base / "cache", "train.steps=3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "was assembled for other settings" in result.stdout
    settings = json.loads((run / "student" / "dofla_settings.json").read_text())
    assert settings["layers"]["train"]["steps"] == 3
    assert json.loads((run / "layers" / "settings.json").read_text())["train"]["steps"] == 3
    assert _features_equal(run / "student", run / "layers")
    old, new = _metrics(base / "run"), _metrics(run)
    assert new["eval/teacher_ppl"] == old["eval/teacher_ppl"]  # the teacher did not change
    assert new["eval/student_ppl"] != old["eval/student_ppl"]


@pytest.mark.long
def test_changed_eval_settings_recompute_instead_of_returning_stale_metrics(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    old = _metrics(run)
    fewer = run_cli(*_args(run, base / "cache", "eval.attn_error_seqs=1"))
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    new = _metrics(run)
    assert new["eval/attn_error/mean"] != old["eval/attn_error/mean"]
    assert {k: v for k, v in new.items() if "attn_error" not in k} == \
        {k: v for k, v in old.items() if "attn_error" not in k}
    (tmp_path / "tasks").mkdir()
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
               "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    tasks = run_cli(*_args(run, base / "cache", "eval.tasks=[piqa_local]", "eval.task_limit=4",
                           f"eval.task_dirs=[{write_local_tasks(tmp_path / 'tasks')}]"), env=offline)
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert {"tasks/teacher/piqa_local/acc", "tasks/student/piqa_local/acc", "tasks/acc_gap"} <= set(_metrics(run))
    assert _metrics(run)["eval/attn_error/mean"] == old["eval/attn_error/mean"]  # back to 2 sequences: reused
    back = run_cli(*_args(run, base / "cache"))
    assert back.returncode == 0, back.stderr[-3000:]
    assert _metrics(run) == old


def _assemble(tmp_path, feature_map: str):
    from dofla.stages.assemble import assemble

    cfg = RunConfig(model=ModelConfig(source="tiny:llama"), feature_map=FeatureMapConfig(name=feature_map),
                    train=TrainConfig(layer_dir=str(tmp_path / "shared")))
    return assemble(cfg, build_tiny_model("llama"), build_byte_tokenizer(), [8, 8], tmp_path / "run",
                    cache_key="k")


def test_assembly_with_a_missing_trained_layer_fails_in_one_sentence(tmp_path):
    from dofla.artifacts import ArtifactError

    with pytest.raises(ArtifactError) as err:
        _assemble(tmp_path, "learned_prf")
    message = str(err.value)
    assert message.startswith("layer 0 has no usable trained features") and str(tmp_path / "shared") in message
    assert "train.layers=[0]" in message and "run without train.layers" in message
    assert message.count(". ") == 0 and not (tmp_path / "run" / "student").exists()


def test_assembly_needs_no_artifact_for_features_without_parameters(tmp_path):
    student = _assemble(tmp_path, "performer")
    assert (tmp_path / "run" / "student" / "dofla_settings.json").exists()
    assert student.dofla_settings["layers"]["feature_map"]["name"] == "performer"
