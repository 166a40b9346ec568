"""A stored tiny run: what identifies every artifact (cache key, layer metas, layer and student
settings, Algorithm 1's settings, the measurement keys), allocation.json and metrics.json must stay
what they were when the fixture was written. A refactor that changes any of them changes what
existing runs resume from, so it fails here unless the change is deliberate (then regenerate:
DOFLA_WRITE_FIXTURE=1 pytest tests/integration/test_behaviour_fixture.py, and say why in the commit).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.test_pipeline import run_cli

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny_run.json"


def _read(path: Path):
    return json.loads(path.read_text())


def snapshot(run_dir: Path) -> dict:
    """The parts of a run directory that identify its artifacts, and its results."""
    layers = sorted((run_dir / "layers").glob("layer_*.pt.json"))
    return {
        "cache_key": _read(run_dir / "run.json")["cache_key"],
        "layer_meta": {p.name: _read(p)["meta"] for p in layers},
        "layer_settings": _read(run_dir / "layers" / "settings.json"),
        "student_settings": _read(run_dir / "student" / "dofla_settings.json"),
        "dof_settings": _read(run_dir / "dof.json")["settings"],
        "measurements": sorted(_read(run_dir / "eval_measurements.json")),
        "allocation": _read(run_dir / "allocation.json"),
        # resources/: this machine's measured memory and step times (and the preflight's prediction beside them)
        "metrics": {k: v for k, v in _read(run_dir / "metrics.json").items() if not k.startswith("resources/")},
    }


def _same(got, want) -> bool:
    """Equal structures, floats within 1e-6 relative (everything else exactly)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, float):
        return isinstance(got, (int, float)) and got == pytest.approx(want, rel=1e-6, abs=1e-9)
    return got == want


def test_a_tiny_run_keeps_its_artifact_keys_allocation_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    got = snapshot(run_dir)
    if os.environ.get("DOFLA_WRITE_FIXTURE"):
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = _read(FIXTURE)
    for key in ("cache_key", "layer_meta", "layer_settings", "student_settings", "dof_settings", "measurements"):
        assert got[key] == want[key], key
    # allocation.json: its dims and settings exactly; its DoF estimates (eigenvalue sums) up to BLAS
    # rounding, which differs between machines in the last bits
    assert _same(got["allocation"], want["allocation"]), "allocation"
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, value in want["metrics"].items():  # the same machine gives the same bits; allow BLAS rounding
        assert got["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
