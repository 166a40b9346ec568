"""The real ``dofla`` command end to end on a tiny random Llama: one run, a rerun, a 2-job sweep."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dofla.feature_maps import HeadBlockFeatureMap
from dofla.models import load_student
from tests.conftest import activation_caches, reproducible


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "dofla", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_full_pipeline_on_tiny_model(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = ["experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    for artifact in ("run.json", "dof.json", "allocation.json", "metrics.json", "report.md", "summary.txt"):
        assert (run_dir / artifact).exists(), artifact
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert math.isfinite(metrics["eval/teacher_ppl"]) and math.isfinite(metrics["eval/student_ppl"])
    assert [k for k in metrics if k.startswith("eval/attn_error/layer_")] == [
        "eval/attn_error/layer_00", "eval/attn_error/layer_01"]
    allocation = json.loads((run_dir / "allocation.json").read_text())
    assert allocation["policy"] == "dof" and len(allocation["dims"]) == 2
    assert "held-out ppl" in first.stdout
    student = load_student(run_dir / "student")
    out = student.generate(torch.tensor([[72, 101, 108]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)

    again = run_cli(*args)  # everything is already there: nothing is recomputed
    assert again.returncode == 0, again.stderr[-3000:]
    assert reproducible(json.loads((run_dir / "metrics.json").read_text())) == reproducible(metrics)
    assert "reus" in (again.stdout + again.stderr).lower()


def test_two_job_multirun_shares_one_cache_and_reports(tmp_path):
    sweep, cache = tmp_path / "sweep", tmp_path / "cache"
    result = run_cli("-m", "experiment=smoke_tiny", "allocation=fix,dof",
                     f"hydra.sweep.dir={sweep}", f"paths.cache_dir={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.rglob("metrics.json"))
    assert len(runs) == 2
    keys = {json.loads((r / "run.json").read_text())["cache_key"] for r in runs}
    assert len(keys) == 1
    assert len(activation_caches(cache)) == 1
    report = (sweep / "report.md").read_text()
    assert "allocation" in report and report.count("\n| ") >= 3
    assert (sweep / "report.csv").exists() and (sweep / "dims.png").exists()


@pytest.mark.parametrize("loss", ["softmax", "direct"])
def test_dof_head_run_trains_assembles_and_evaluates_per_head_blocks(tmp_path, loss):
    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", "allocation=dof_head", f"loss={loss}", f"hydra.run.dir={run_dir}",
                     f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    allocation = json.loads((run_dir / "allocation.json").read_text())
    per_head = json.loads((run_dir / "dof.json").read_text())["per_head"]
    assert allocation["policy"] == "dof_head" and [len(layer) for layer in allocation["dims"]] == [4, 4]
    assert all(m % 8 == 0 for layer in allocation["dims"] for m in layer)
    for dims, dof in zip(allocation["dims"], per_head):  # more DoF, never fewer features
        assert [dims[h] for h in sorted(range(4), key=dof.__getitem__)] == sorted(dims)
    student = load_student(run_dir / "student")
    for attn, dims in zip(student.student_attentions(), allocation["dims"]):
        fm = attn.feature_map
        assert (fm.head_dims if isinstance(fm, HeadBlockFeatureMap) else [fm.num_features] * 4) == dims
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert math.isfinite(metrics["eval/student_ppl"]) and "eval/attn_error/layer_01" in metrics
    if loss == "softmax":  # the layers really trained: held-out loss went down in each
        summary = json.loads((run_dir / "train_summary.json").read_text())
        assert all(s["final_heldout_loss"] < s["initial_heldout_loss"] for s in summary.values())


def test_bad_value_fails_before_compute_in_one_sentence(tmp_path):
    result = run_cli("experiment=smoke_tiny", "allocation.lam=-1", f"hydra.run.dir={tmp_path / 'run'}",
                     f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 2
    assert "allocation.lam=-1" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.long  # a real multirun runs by default (test_two_job_multirun_shares_one_cache_and_reports)
def test_sweep_through_submitit_local_launcher(tmp_path):
    """The same launcher plugin a SLURM user picks (submitit), run locally for real."""
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "experiment=smoke_tiny", "allocation=fix,dof", "hydra/launcher=submitit_local",
                     "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list(sweep.rglob("metrics.json"))) == 2
    assert (sweep / "report.md").exists()


@pytest.mark.long
def test_sweep_through_joblib_launcher_builds_the_shared_cache_once(tmp_path):
    """Two jobs in parallel processes (joblib) need the same cache: one builds it under the lock."""
    sweep, cache = tmp_path / "sweep", tmp_path / "cache"
    result = run_cli("-m", "experiment=smoke_tiny", "allocation=fix,dof", "hydra/launcher=joblib",
                     "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.rglob("metrics.json"))
    assert len(runs) == 2 and len(activation_caches(cache)) == 1
    assert (sweep / "report.md").exists()
