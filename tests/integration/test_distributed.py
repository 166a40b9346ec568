"""Data parallelism: ``torchrun --nproc_per_node=2 -m dofla`` (gloo, CPU) gives what one process gives.

Both sides run with one thread per process, so every matmul is computed the same way and the
cache, the layerwise-trained features and the evaluation agree (sums across ranks only reorder
float64 additions). ``direct`` splits each batch over the ranks and averages gradients: the same
steps up to float rounding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.integration.test_pipeline import run_cli

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def torchrun(*args: str, nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "dofla", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def _both(tmp_path, *args: str):
    """(one-process run dir, two-process run dir) for the same arguments; separate caches."""
    dirs = {}
    for name, launch in (("single", lambda *a: run_cli(*a, env=ENV)), ("ddp", torchrun)):
        run_dir = tmp_path / name
        result = launch("experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / name}_cache",
                        *args)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        dirs[name] = run_dir
    return dirs["single"], dirs["ddp"]


def _cache_arrays(cache_root):
    (cache,) = [p for p in cache_root.iterdir() if p.is_dir()]
    return {p.name: np.load(p) for p in sorted(cache.glob("*.npy"))}


def _metrics(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in metrics.items() if k.startswith("eval/")}


def test_two_processes_equal_one_layerwise(tmp_path):
    single, ddp = _both(tmp_path, "data.num_tokens=1536")  # 24 sequences: 6 batches, 3 per rank
    one, two = _cache_arrays(tmp_path / "single_cache"), _cache_arrays(tmp_path / "ddp_cache")
    assert one.keys() == two.keys() and all(np.array_equal(one[k], two[k]) for k in one)
    assert json.loads((ddp / "run.json").read_text())["world_size"] == 2
    for name in ("dof.json", "allocation.json"):
        assert json.loads((single / name).read_text()) == json.loads((ddp / name).read_text())
    for layer in ("layer_00.pt", "layer_01.pt"):  # layer 0 trained on rank 0, layer 1 on rank 1
        a = torch.load(single / "layers" / layer, weights_only=False)["state_dict"]
        b = torch.load(ddp / "layers" / layer, weights_only=False)["state_dict"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    m1, m2 = _metrics(single), _metrics(ddp)
    assert m1.keys() == m2.keys()
    assert all(m2[k] == pytest.approx(m1[k], rel=1e-9) for k in m1)


def test_two_processes_equal_one_direct(tmp_path):
    single, ddp = _both(tmp_path, "loss=direct", "train.direct_batch_size=2")
    for layer in ("layer_00.pt", "layer_01.pt"):
        a = torch.load(single / "layers" / layer, weights_only=False)["state_dict"]
        b = torch.load(ddp / "layers" / layer, weights_only=False)["state_dict"]
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    curve1 = json.loads((single / "layers" / "direct_done.json").read_text())["curve"]
    curve2 = json.loads((ddp / "layers" / "direct_done.json").read_text())["curve"]
    assert [p["loss"] for p in curve2] == pytest.approx([p["loss"] for p in curve1], rel=1e-4)
    m1, m2 = _metrics(single), _metrics(ddp)
    assert all(m2[k] == pytest.approx(m1[k], rel=1e-4) for k in m1)


def test_direct_batch_that_cannot_be_split_is_one_sentence(tmp_path):
    result = torchrun("experiment=smoke_tiny", "loss=direct", "train.direct_batch_size=1",
                      f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode != 0
    assert "train.direct_batch_size=1 cannot be split evenly over 2 torchrun processes" in result.stderr
    assert not (tmp_path / "cache").exists()
