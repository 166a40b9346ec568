"""``dofla-gpucheck`` run for real on the CPU (tiny shapes, automatic there): its JSON has every field a
GPU user reads, and a failing check exits non-zero with one sentence."""
from __future__ import annotations

import json
import math

import pytest

from dofla import gpucheck, gpucheck_cells


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpucheck") / "gpucheck.json"
    code = gpucheck.main(["--out", str(out), "--teachers", "gpt2"])  # Pythia's cells run the same code
    return code, json.loads(out.read_text())


def test_on_the_cpu_every_cell_and_precision_is_checked_at_tiny_shapes(checked):
    code, report = checked
    assert code == 0 and report["ok"] and report["failure"] is None, report["failure"]
    assert report["tiny"] and report["device"]["type"] == "cpu"
    cells = {(c["teacher"], c["stage"], c["precision"]) for c in report["checks"]}
    assert cells == {("gpt2", s, p) for s in ("distill:softmax", "distill:l2", "distill:direct", "finetune")
                     for p in ("fp32", "bf16")}  # tf32 is a CUDA matmul mode
    for c in report["checks"]:
        assert c["problem"] is None and c["seq_len"] == 64 and c["micro_batch"] == c["batch"] == 4
        assert c["tokens_per_s"] > 0 and c["step_s"] > 0 and c["projected_cell_hours"] > 0
        assert c["measured_kind"] == "rss" and c["measured_peak_bytes"] > 0 and c["predicted_peak_bytes"] > 0
        assert isinstance(c["host_syncs_per_step"], int)
    # the streamed layerwise step reads the host once per layer per step (the finiteness check) at least
    streamed = [c for c in report["checks"] if c["stage"] == "distill:softmax"]
    assert all(c["host_syncs_per_step"] >= 2 for c in streamed)


def test_the_sweeps_add_up_every_cell_and_the_teachers_grid(checked):
    _, report = checked
    hours = {(c["teacher"], c["stage"], c["precision"]): c["projected_cell_hours"] for c in report["checks"]}
    gpt2 = (3 * sum(hours["gpt2", f"distill:{loss}", "fp32"] for loss in ("softmax", "l2", "direct"))
            + (11 + gpucheck_cells.GRID) * hours["gpt2", "finetune", "fp32"])
    assert report["sweeps"]["gpt2"]["fp32"] == pytest.approx(gpt2)
    assert set(report["sweeps"]["gpt2"]) == {"fp32", "bf16"}
    assert all(math.isfinite(h) and h > 0 for h in report["sweeps"]["gpt2"].values())


def test_the_gpu_tests_run_and_are_skipped_here(checked):
    _, report = checked
    tests = report["gpu_tests"]
    assert tests["ran"] and tests["returncode"] == 0 and tests["files"] >= 2
    assert "skipped" in tests["summary"]


def test_a_failing_check_exits_non_zero_with_one_sentence(tmp_path, capsys):
    code = gpucheck.main(["--out", str(tmp_path / "g.json"), "--no-tests", "--teachers", "gpt2",
                          "--precisions", "fp32", "--memory-limit-gb", "0.001"])
    report = json.loads((tmp_path / "g.json").read_text())
    assert code == 1 and not report["ok"]
    failed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dofla-gpucheck")]
    assert len(failed) == 1  # one sentence (transformers may warn on stderr too)
    assert failed[0].startswith("dofla-gpucheck failed: gpt2 distill:softmax (fp32): does not fit even at "
                                "micro-batch 1 (≈ ")
