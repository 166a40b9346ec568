"""Layer artifacts are verified on read; per-layer parallel jobs give the single-job result."""
from __future__ import annotations

import json

import pytest

from tests.conftest import reproducible
from tests.integration.test_pipeline import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    result = run_cli("experiment=smoke_tiny", f"hydra.run.dir={root / 'run'}", f"paths.cache_dir={root / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_damaged_layer_artifact_is_detected_and_retrained(trained, tmp_path, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    artifact = run / "layers" / "layer_01.pt"
    data = artifact.read_bytes()
    if damage == "truncate":
        artifact.write_bytes(data[: len(data) // 3])
    elif damage == "flip":
        artifact.write_bytes(data[:200] + bytes(b ^ 0x5A for b in data[200:220]) + data[220:])
    else:
        sidecar = artifact.with_name("layer_01.pt.json")
        record = json.loads(sidecar.read_text())
        record["meta"]["num_features"] += 1
        sidecar.write_text(json.dumps(record))
    for stale in ("student", "metrics.json"):
        shutil.rmtree(run / stale, ignore_errors=True) if stale == "student" else (run / stale).unlink()
    result = run_cli("experiment=smoke_tiny", f"hydra.run.dir={run}", f"paths.cache_dir={trained / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layer_01.pt is not usable" in result.stdout
    assert reproducible(json.loads((run / "metrics.json").read_text())) == \
        reproducible(json.loads((trained / "run" / "metrics.json").read_text()))


def test_per_layer_parallel_jobs_equal_one_job(trained, tmp_path):
    shared, cache = tmp_path / "layers", trained / "cache"
    sweep = run_cli("-m", "experiment=smoke_tiny", "train.layers=[0],[1]", f"train.layer_dir={shared}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", f"paths.cache_dir={cache}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    (settings_dir,) = [p for p in shared.iterdir() if p.is_dir()]  # both jobs: the same settings
    assert sorted(p.name for p in settings_dir.glob("*.pt")) == ["layer_00.pt", "layer_01.pt"]
    final = run_cli("experiment=smoke_tiny", f"train.layer_dir={shared}", f"hydra.run.dir={tmp_path / 'run'}",
                    f"paths.cache_dir={cache}")
    assert final.returncode == 0, final.stderr[-3000:]
    assert reproducible(json.loads((tmp_path / "run" / "metrics.json").read_text())) == \
        reproducible(json.loads((trained / "run" / "metrics.json").read_text()))
