"""dofla-report --table hybrid (dofla.report.hybrid_table): rows over seeds against a training-free baseline."""
from __future__ import annotations

import json
import math

import pytest

from dofla.cli import report_main
from dofla.report.hybrid_table import load_rows, main, main_table, position_table, probe_table, run_gap_closed

TEACHER, BASE = 2.0, 3.0  # held-out losses


def _write(root, name, loss, ablated=None, probes=False):
    m = {"eval/student_loss": loss, "eval/student_ppl": math.exp(loss), "eval/teacher_loss": TEACHER,
         "eval/teacher_ppl": math.exp(TEACHER), "eval/attn_error/mean": 0.2,
         "position/teacher/1-8": 2.0, "position/student/1-8": loss, "position/teacher/8-16": 2.0,
         "position/student/8-16": loss + 0.5}
    if ablated is not None:
        m.update({"ablate/student_loss": ablated, "ablate/student_ppl": math.exp(ablated)})
    if probes:
        m.update({"passkey/teacher/T64": 1.0, "passkey/student/T64": 0.5, "mqar/teacher/T8": 0.3, "mqar/student/T8": 0.1,
                  "passkey_nll/teacher/T64": 0.6, "passkey_nll/student/T64": 7.25})
    (root / name).mkdir()
    (root / name / "metrics.json").write_text(json.dumps(m))
    (root / name / "run.json").write_text(json.dumps({"config": {"seed": 0}}))


def test_gap_closed_and_rows_over_seeds(tmp_path, capsys):
    _write(tmp_path, "base_s0", BASE, probes=True)
    for seed, loss in enumerate([2.5, 2.6, 2.4]):
        _write(tmp_path, f"hyb_s{seed}", loss, ablated=BASE, probes=seed == 0)
    (tmp_path / "not_a_run").mkdir()
    rows = load_rows(tmp_path)
    assert sorted(rows) == ["base", "hyb"] and sorted(rows["hyb"]) == [0, 1, 2]
    assert run_gap_closed(rows["hyb"][0], BASE) == pytest.approx(0.5)
    table = main_table(rows, "base")
    hyb = next(line for line in table.splitlines() if line.startswith("| hyb |"))
    # gap closed: 50 %, 40 %, 60 % → mean 50 ± t(0.975, 2)·10/√3 = 24.8; the linear part gains 0.5 nats
    assert "| 0,1,2 |" in hyb and "50 ± 25 %" in hyb and "| 0.5 ± 0.25 |" in hyb
    assert "| base | 0 |" in table and "| 0 % |" in table
    positions = position_table(rows)
    assert "| [1, 8) | 7.39 |" in positions and "(1.65×)" in positions
    probes = probe_table(rows)
    assert "| passkey T64 | 1.00 | 0.50 | 0.50 |" in probes and "mqar T8" in probes
    assert "| passkey_nll T64 | 0.60 | 7.25 | 7.25 |" in probes
    main([str(tmp_path), "--baseline", "base"])
    assert "| hyb |" in capsys.readouterr().out
    report_main(["--table", "hybrid", str(tmp_path), "--baseline", "base"])  # the command line's way in
    assert "| hyb |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="'hybrd' is not a table; choose one of: hybrid, tokens"):
        report_main(["--table=hybrd", str(tmp_path)])
    with pytest.raises(SystemExit, match="--baseline"):
        main([str(tmp_path), "--baseline", "sw4"])
    with pytest.raises(SystemExit, match="--teacher"):
        main([str(tmp_path), "--baseline", "base", "--teacher", "teacher_lora"])


def test_a_row_stands_in_for_the_teacher_paired_by_seed(tmp_path):
    """Baseline and teacher rows with seeds: each seed is compared with the same seed's references."""
    for seed, (base, top, row) in enumerate([(3.0, 2.0, 2.5), (3.2, 2.2, 2.2)]):
        _write(tmp_path, f"base_s{seed}", base)
        _write(tmp_path, f"top_s{seed}", top)
        _write(tmp_path, f"row_s{seed}", row)
    _write(tmp_path, "row_s2", 2.5)  # no references at seed 2: their means over seeds (3.1, 2.1)
    table = main_table(load_rows(tmp_path), "base", "top")
    row = next(line for line in table.splitlines() if line.startswith("| row | 0"))
    # seed 0: 50 %, seed 1: 100 %, seed 2: (3.1 − 2.5) / (3.1 − 2.1) = 60 % → mean 70
    assert "| 0,1,2 |" in row and "| 70 ± " in row
    assert "gap `base` → `top` closed" in table
