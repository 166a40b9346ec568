"""report: a sweep directory of runs -> report.md, report.csv, plots, and record differences."""
from __future__ import annotations

import csv

from dofla.record import write_json
from dofla.report import write_report
from dofla.report.tables import distinguishing_overrides


def _fake_run(path, policy, ppl, sha, dims):
    write_json(path / "run.json", {"overrides": [f"allocation={policy}", "model=tiny_llama"],
                                   "git": {"sha": sha, "dirty": False}, "packages": {"torch": "2.13"},
                                   "device": "cpu", "cache_key": "abc"})
    write_json(path / "allocation.json", {"policy": policy, "dims": dims, "budget": 16})
    write_json(path / "dof.json", {"per_head": [[3.0, 4.0], [5.0, 1.0]], "layer_dof": [4.0, 5.0]})
    write_json(path / "metrics.json", {"eval/teacher_ppl": 10.0, "eval/student_ppl": ppl,
                                       "eval/attn_error/layer_00": 0.5, "eval/attn_error/layer_01": 0.4})


def test_sweep_report_compares_runs_and_flags_code_differences(tmp_path):
    _fake_run(tmp_path / "0", "fix", 20.0, "aaa", [16, 16])
    _fake_run(tmp_path / "1", "dof", 15.0, "bbb", [14, 18])
    report = write_report(tmp_path)
    text = report.read_text()
    assert "allocation" in text and "model" not in text.split("\n")[2]  # only distinguishing keys
    assert "runs differ in git" in text
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [r["allocation"] for r in rows] == ["fix", "dof"]
    assert {r["eval/student_ppl"] for r in rows} == {"20.0", "15.0"}
    for plot in ("dims.png", "attn_error.png", "dof_heatmap.png", "perplexity.png"):
        assert (tmp_path / plot).stat().st_size > 1000
        assert f"({plot})" in text


def test_distinguishing_overrides_ignores_shared_values():
    runs = [{"overrides": ["a=1", "b=2"]}, {"overrides": ["a=1", "b=3"]}, {"overrides": ["a=1"]}]
    assert distinguishing_overrides(runs) == ["b"]
