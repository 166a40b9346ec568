"""Kill the real CLI with SIGKILL inside each stage, re-run the same command, get the same result.

``DOFLA_KILL_AT=<point>`` makes the process SIGKILL itself at that point (see dofla.faults): a
real kill at a deterministic place, with no handler or cleanup running.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import reproducible

# one kill point runs by default (inside training), the rest in the long tier
KILL_POINTS = ["train:layer1:step4"] + [
    pytest.param(point, marks=pytest.mark.long)
    for point in ("cache:batch1", "dof:layer1", "assemble", "eval:student", "eval:attention")]


def _run(run_dir, cache_dir, kill_at=None, extra=()):
    env = dict(os.environ)
    env.pop("DOFLA_KILL_AT", None)
    if kill_at:
        env["DOFLA_KILL_AT"] = kill_at
    args = ["experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", *extra]
    return subprocess.run([sys.executable, "-m", "dofla", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def _outputs(run_dir):
    return {"allocation.json": json.loads((run_dir / "allocation.json").read_text()),
            "metrics.json": reproducible(json.loads((run_dir / "metrics.json").read_text()))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline")
    result = _run(root / "run", root / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    return _outputs(root / "run")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_run_resumes_to_identical_results(point, tmp_path, uninterrupted):
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    killed = _run(run_dir, cache_dir, kill_at=point)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert not (run_dir / "metrics.json").exists()
    resumed = _run(run_dir, cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _outputs(run_dir) == uninterrupted


DISTILL = ["distill=kl", "distill.tokens=1024", "distill.batch_size=2", "distill.micro_batch_size=1",
           "distill.checkpoint_every=3"]


@pytest.mark.long
def test_a_run_killed_inside_distillation_resumes_from_its_checkpoint(tmp_path):
    base = tmp_path / "base"
    assert _run(base / "run", base / "cache", extra=DISTILL).returncode == 0
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    killed = _run(run_dir, cache_dir, kill_at="distill:step5", extra=DISTILL)  # 8 steps; checkpoint at 3
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert (run_dir / "distill_ckpt.pt").exists() and not (run_dir / "student_distilled").exists()
    resumed = _run(run_dir, cache_dir, extra=DISTILL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _outputs(run_dir) == _outputs(base / "run")
    summary = json.loads((run_dir / "distill_summary.json").read_text())
    assert summary["tokens"] == 1024 and [c["step"] for c in summary["curve"]] == list(range(8))


def _sweep(sweep_dir, cache_dir, kill_at=None):
    env = {k: v for k, v in os.environ.items() if k != "DOFLA_KILL_AT"}
    if kill_at:
        env["DOFLA_KILL_AT"] = kill_at
    args = ["-m", "allocation=fix,dof", "experiment=smoke_tiny", f"hydra.sweep.dir={sweep_dir}",
            f"paths.cache_dir={cache_dir}"]
    return subprocess.run([sys.executable, "-m", "dofla", *args], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.long
def test_a_killed_sweep_relaunched_into_its_directory_resumes_every_cell(tmp_path):
    """The cluster recipe (docs/guide/sweeps_and_clusters.md): the same -m command with the same
    hydra.sweep.dir, after the sweep died inside its first cell, resumes that cell and runs the
    rest; every cell ends where an uninterrupted sweep's does."""
    killed = _sweep(tmp_path / "sweep", tmp_path / "cache", kill_at="train:layer1:step4")
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "sweep" / "0").is_dir() and not (tmp_path / "sweep" / "0" / "metrics.json").exists()
    resumed = _sweep(tmp_path / "sweep", tmp_path / "cache")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    clean = _sweep(tmp_path / "clean", tmp_path / "cache")
    assert clean.returncode == 0, clean.stderr[-3000:]
    for cell in ("0", "1"):
        assert _outputs(tmp_path / "sweep" / cell) == _outputs(tmp_path / "clean" / cell)
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.name.isdigit()) == ["0", "1"]
