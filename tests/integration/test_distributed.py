"""Data parallelism: ``torchrun --nproc_per_node=2 -m dofla`` (gloo, CPU) gives what one process gives.

Both sides run with one thread per process, so every matmul is computed the same way and the
cache, the layerwise-trained features and the evaluation agree (sums across ranks only reorder
float64 additions). ``direct``, and layerwise training from a stream, split each batch over the ranks
and average gradients: the same steps up to float rounding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import activation_caches
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
    (cache,) = activation_caches(cache_root)
    return {p.name: np.load(p) for p in sorted(cache.glob("*.npy"))}


def _metrics(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in metrics.items() if k.startswith("eval/")}


@pytest.mark.long  # data parallelism runs by default in tests/component/test_data_parallel.py (gloo processes)
def test_two_processes_equal_one_layerwise(tmp_path):
    single, ddp = _both(tmp_path, "data.num_tokens=1536")  # 24 sequences: 6 batches, 3 per rank
    one, two = _cache_arrays(tmp_path / "single_cache"), _cache_arrays(tmp_path / "ddp_cache")
    assert one.keys() == two.keys() and all(np.array_equal(one[k], two[k]) for k in one)
    run = json.loads((ddp / "run.json").read_text())
    assert run["world_size"] == 2 and run["train_parallel"] == "layers"  # the cache: layer i on rank i mod 2
    for name in ("dof.json", "allocation.json"):
        assert json.loads((single / name).read_text()) == json.loads((ddp / name).read_text())
    for layer in ("layer_00.pt", "layer_01.pt"):  # layer 0 trained on rank 0, layer 1 on rank 1
        a = torch.load(single / "layers" / layer, weights_only=False)["state_dict"]
        b = torch.load(ddp / "layers" / layer, weights_only=False)["state_dict"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    m1, m2 = _metrics(single), _metrics(ddp)
    assert m1.keys() == m2.keys()
    assert all(m2[k] == pytest.approx(m1[k], rel=1e-9) for k in m1)


@pytest.mark.long
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


STREAM = ["train.source=stream", "data.num_tokens=2048", "data.cache_tokens=256", "train.batch_size=4",
          "train.micro_batch_size=1"]


def _layer_states(run_dir):
    return {layer: torch.load(run_dir / "layers" / layer, weights_only=False)["state_dict"]
            for layer in ("layer_00.pt", "layer_01.pt")}


@pytest.mark.long
def test_two_processes_split_every_streamed_batch(tmp_path):
    """train.parallel=auto on a stream: each rank runs the teacher on 2 of the 4 rows (one micro-batch at a
    time), the layers' gradients are averaged; the one-process run at batch 4 takes the same steps."""
    single, ddp = _both(tmp_path, *STREAM)
    assert json.loads((ddp / "run.json").read_text())["train_parallel"] == "data"
    one, two = _layer_states(single), _layer_states(ddp)
    for layer in one:
        assert all(torch.allclose(one[layer][k], two[layer][k], rtol=1e-4, atol=1e-6) for k in one[layer])
    s1 = json.loads((single / "train_summary.json").read_text())
    s2 = json.loads((ddp / "train_summary.json").read_text())
    for layer in s1:
        assert s2[layer]["tokens"] == s1[layer]["tokens"] == 2048  # 8 steps of 4 × 64
        assert [p["loss"] for p in s2[layer]["curve"]] == pytest.approx([p["loss"] for p in s1[layer]["curve"]],
                                                                        rel=1e-4)
        assert s2[layer]["final_heldout_loss"] == pytest.approx(s1[layer]["final_heldout_loss"], rel=1e-4)
    m1, m2 = _metrics(single), _metrics(ddp)
    assert all(m2[k] == pytest.approx(m1[k], rel=1e-4) for k in m1)


@pytest.mark.long
def test_two_processes_can_still_split_the_layers_of_a_stream(tmp_path):
    """train.parallel=layers: each rank streams the whole batch for its own layers (exactly one process's result)."""
    single, ddp = _both(tmp_path, *STREAM, "train.parallel=layers")
    assert json.loads((ddp / "run.json").read_text())["train_parallel"] == "layers"
    one, two = _layer_states(single), _layer_states(ddp)
    assert all(torch.equal(one[layer][k], two[layer][k]) for layer in one for k in one[layer])


@pytest.mark.long
def test_two_processes_distil_like_one(tmp_path):
    """distill=kl under torchrun: each rank its row of every 2-row batch, gradients averaged, rank 0 writes."""
    single, ddp = _both(tmp_path, "distill=kl", "distill.tokens=1024", "distill.batch_size=2")
    c1 = json.loads((single / "distill_summary.json").read_text())
    c2 = json.loads((ddp / "distill_summary.json").read_text())
    assert c2["tokens"] == c1["tokens"] == 1024
    # the tiny student starts near its teacher (KL ≈ 6e-6): float rounding is absolute here
    assert [p["kl"] for p in c2["curve"]] == pytest.approx([p["kl"] for p in c1["curve"]], rel=1e-4, abs=1e-7)
    m1, m2 = _metrics(single), _metrics(ddp)
    assert all(m2[k] == pytest.approx(m1[k], rel=1e-4) for k in m1)
    # the preflight sizes each process's share: one row per rank is a batch of one sequence (two traces)
    p1, p2 = (json.loads((d / "preflight.json").read_text())["distill"] for d in (single, ddp))
    assert (p1["batch"], p2["batch"]) == (2, 1)
    assert p1["per_sample"] > 0 and p2["per_sample"] is None


@pytest.mark.long
def test_streamed_batch_that_cannot_be_split_is_one_sentence(tmp_path):
    result = torchrun("experiment=smoke_tiny", *STREAM[:3], "train.batch_size=3",
                      f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode != 0
    assert "train.batch_size=3 cannot be split evenly over 2 torchrun processes" in result.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.long
def test_direct_batch_that_cannot_be_split_is_one_sentence(tmp_path):
    result = torchrun("experiment=smoke_tiny", "loss=direct", "train.direct_batch_size=1",
                      f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode != 0
    assert "train.direct_batch_size=1 cannot be split evenly over 2 torchrun processes" in result.stderr
    assert not (tmp_path / "cache").exists()
