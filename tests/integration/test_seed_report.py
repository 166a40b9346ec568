"""A real three-seed sweep of fix, dof and fix_max, then ``dofla-report``: every mean, interval and
paired difference in report.csv equals what is computed here by hand from the runs' metrics.json."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_pipeline import run_cli

SEEDS = (0, 1, 2)
BUDGET = 40  # the tiny Llama's two layers get 41 and 39 features from dof here, so dof ≠ fix


def _t975_df2() -> float:
    """t(0.975, 2) in closed form: F(t) = 1/2 + t / (2√(t² + 2)) solved for F = 0.975 (≈ 4.303)."""
    a = 2 * 0.975 - 1
    return a * math.sqrt(2 / (1 - a * a))


def _by_hand(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, _t975_df2() * sd / math.sqrt(len(values))


def _report(sweep: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("dofla-report")
    fallback = [sys.executable, "-c", "from dofla.cli import report_main; report_main()"]
    command = [str(script)] if script.exists() else fallback
    return subprocess.run([*command, str(sweep)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled"})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    result = run_cli("-m", "model=tiny_llama", "allocation=fix,dof,fix_max", "seed=0,1,2", "eval.tasks=[]",
                     "train=smoke", "data.seq_len=64", "data.num_tokens=1024", "data.heldout_tokens=256",
                     "allocation.num_samples=128", "budget=absolute", f"budget.value={BUDGET}",
                     # one J-sample, max over heads (the paper's): on a random tiny model the averaged
                     # default gives near-equal layer DoF, so dof (and fix_max) would equal fix
                     "allocation.resamples=1", "allocation.head_aggregate=max",
                     "stages=[cache,dof,allocate,train,assemble,eval]",  # the sweep report only: faster
                     f"hydra.sweep.dir={root / 'sweep'}", f"paths.cache_dir={root / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("report.md", "report.csv"):  # the sweep's own report: make dofla-report write it anew
        (root / "sweep" / name).unlink()
    report = _report(root / "sweep")
    assert report.returncode == 0, report.stderr[-3000:]
    runs = {}
    for path in (root / "sweep").rglob("run.json"):
        config = json.loads(path.read_text())["config"]
        runs[(config["allocation"]["policy"], config["seed"])] = {
            "metrics": json.loads((path.parent / "metrics.json").read_text()),
            "dims": json.loads((path.parent / "allocation.json").read_text())["dims"]}
    assert len(runs) == 9
    rows = {(r["allocation"], int(r["seed"])): r for r in csv.DictReader(open(root / "sweep" / "report.csv"))}
    return runs, rows, (root / "sweep" / "report.md").read_text()


def test_every_setting_has_its_mean_and_t_interval_over_seeds(sweep):
    runs, rows, text = sweep
    assert abs(_t975_df2() - 4.303) < 5e-4
    for policy in ("fix", "dof", "fix_max"):
        ppl = [runs[(policy, s)]["metrics"]["eval/student_ppl"] for s in SEEDS]
        err = [runs[(policy, s)]["metrics"]["eval/attn_error/mean"] for s in SEEDS]
        for seed in SEEDS:
            row = rows[(policy, seed)]
            assert row["n_seeds"] == "3"
            for column, values in (("eval/student_ppl", ppl), ("eval/attn_error/mean", err)):
                mean, half = _by_hand(values)
                assert float(row[f"{column}_mean"]) == pytest.approx(mean, rel=1e-9)
                assert float(row[f"{column}_ci95"]) == pytest.approx(half, rel=1e-6)
    assert "Student-t" in text and " ± " in text


def test_policies_are_paired_with_fix_at_the_same_seed(sweep):
    runs, rows, text = sweep
    for policy in ("dof", "fix_max"):
        fix = [runs[("fix", s)]["metrics"] for s in SEEDS]
        own = [runs[(policy, s)]["metrics"] for s in SEEDS]
        loss_diff = [math.log(m["eval/student_ppl"]) - math.log(f["eval/student_ppl"]) for m, f in zip(own, fix)]
        ppl_diff = [m["eval/student_ppl"] - f["eval/student_ppl"] for m, f in zip(own, fix)]
        closed = [(math.log(f["eval/student_ppl"]) - math.log(m["eval/student_ppl"]))
                  / (math.log(f["eval/student_ppl"]) - math.log(m["eval/teacher_ppl"])) for m, f in zip(own, fix)]
        assert any(d != 0 for d in loss_diff)  # the policies really differ from fix at this budget
        for seed in SEEDS:
            row = rows[(policy, seed)]
            assert row["vs_fix/n_pairs"] == "3"
            assert float(row["vs_fix/loss_diff"]) == pytest.approx(loss_diff[seed], rel=1e-9, abs=1e-15)
            for name, values in (("loss_diff", loss_diff), ("ppl_diff", ppl_diff), ("gap_closed", closed)):
                mean, half = _by_hand(values)
                assert float(row[f"vs_fix/{name}_mean"]) == pytest.approx(mean, rel=1e-6, abs=1e-12)
                assert float(row[f"vs_fix/{name}_ci95"]) == pytest.approx(half, rel=1e-6, abs=1e-12)
        assert f"| {policy} | {policy} | 3 |" in text.split("Paired against `fix`")[1]
    assert all(rows[("fix", s)].get("vs_fix/loss_diff", "") == "" for s in SEEDS)


def test_fix_max_runs_every_layer_at_the_largest_dof_dim_and_reports_its_cost(sweep):
    runs, rows, _ = sweep
    for seed in SEEDS:
        dof, fix_max = runs[("dof", seed)]["dims"], runs[("fix_max", seed)]["dims"]
        assert fix_max == [max(dof)] * len(dof) and runs[("fix", seed)]["dims"] == [BUDGET] * len(dof)
    cost = [max(runs[("dof", s)]["dims"]) / BUDGET for s in SEEDS]
    assert float(rows[("fix_max", 0)]["cost_mean"]) == pytest.approx(sum(cost) / 3) and min(cost) > 1
    assert float(rows[("fix", 0)]["cost_mean"]) == 1.0
