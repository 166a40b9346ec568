"""report: a sweep directory of runs -> report.md, report.csv, plots, and record differences."""
from __future__ import annotations

import csv

from dofla.record import write_json
from dofla.report import write_report
from dofla.report.tables import distinguishing_overrides, gap_closed, load_run


def _fake_run(path, policy, ppl, sha, dims, acc=0.4):
    config = {"allocation": {"policy": policy, "lam": 0.01}, "model": {"source": "tiny"}, "cache_dir": str(path)}
    write_json(path / "run.json", {"config": config, "overrides": [f"allocation={policy}", "model=tiny_llama"],
                                   "git": {"sha": sha, "dirty": False}, "packages": {"torch": "2.13"},
                                   "device": "cpu", "cache_key": "abc"})
    write_json(path / "allocation.json", {"policy": policy, "dims": dims, "budget": 16})
    write_json(path / "dof.json", {"per_head": [[3.0, 4.0], [5.0, 1.0]], "layer_dof": [4.0, 5.0]})
    write_json(path / "metrics.json", {"eval/teacher_ppl": 10.0, "eval/student_ppl": ppl,
                                       "eval/attn_error/layer_00": 0.5, "eval/attn_error/layer_01": 0.4,
                                       "tasks/teacher/piqa/acc": 0.6, "tasks/student/piqa/acc": acc,
                                       "tasks/teacher/avg_acc": 0.6, "tasks/student/avg_acc": acc,
                                       "mqar/teacher/T64": 0.9, "mqar/teacher/T128": 0.8,
                                       "mqar/student/T64": acc, "mqar/student/T128": acc / 2})


def test_sweep_report_compares_runs_and_flags_code_differences(tmp_path):
    _fake_run(tmp_path / "0", "fix", 20.0, "aaa", [16, 16])
    _fake_run(tmp_path / "1", "dof", 15.0, "bbb", [14, 18], acc=0.5)
    report = write_report(tmp_path)
    text = report.read_text()
    assert "allocation" in text and "model" not in text.split("\n")[2]  # only distinguishing keys
    assert "runs differ in git" in text
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [r["allocation"] for r in rows] == ["fix", "dof"]
    assert {r["eval/student_ppl"] for r in rows} == {"20.0", "15.0"}
    # dof closes (20 - 15) / (20 - 10) of the gap left by its fix twin
    assert "| allocation=dof | dof | 20 | 15 | 10 | 0.5 |" in text
    assert "tasks/student/avg_acc" in text.split("\n")[2]
    for plot in ("dims.png", "attn_error.png", "dof_heatmap.png", "perplexity.png", "tasks.png", "mqar.png",
                 "gap_closed.png"):
        assert (tmp_path / plot).stat().st_size > 1000
        assert f"({plot})" in text


def test_distinguishing_overrides_ignores_shared_values():
    runs = [{"overrides": ["a=1", "b=2"]}, {"overrides": ["a=1", "b=3"]}, {"overrides": ["a=1"]}]
    assert distinguishing_overrides(runs) == ["b"]


def test_gap_closed_needs_a_fix_twin_with_the_same_config(tmp_path):
    _fake_run(tmp_path / "0", "fix", 20.0, "aaa", [16, 16])
    _fake_run(tmp_path / "1", "dof", 15.0, "aaa", [14, 18])
    run = load_run(tmp_path / "1")
    run["record"]["config"]["allocation"]["lam"] = 0.5  # a different λ: not comparable with the fix run
    assert gap_closed([load_run(tmp_path / "0"), run]) == []
    assert [c["gap_closed"] for c in gap_closed([load_run(tmp_path / "0"), load_run(tmp_path / "1")])] == [0.5]
