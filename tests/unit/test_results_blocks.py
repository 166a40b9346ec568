"""The blocks that let the results prose quote per-order and per-policy numbers from the records."""
from __future__ import annotations

import json
import math

from dofla.report import load_records
from studies import records, results
from studies.dof_tables import MAIN_HEADER
from tests.unit.test_results_tables import SEQS, fake_run, measure


def test_the_orders_block_gives_each_run_of_a_student_with_several(tmp_path):
    for seed in range(2):
        run = fake_run(tmp_path / "runs", f"d_s{seed}", "linear_delta_kl", seed, 1.2)
        far = {"seq/position/student/1024-2048": [4.0 + seed] * 2, "seq/position/teacher/1024-2048": [2.5, 2.7]}
        measure(run, "position", {"position/student/1024-2048": 4.0 + seed, **far})  # the loss by position
    fake_run(tmp_path / "runs", "r_s0", "hybrid_recall", 0, 0.0)  # one run: no rows of its own
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    loaded = load_records(tmp_path / "records")
    rows = results.headline(loaded)[("headline", "orders")].splitlines()[2:]
    delta = [r for r in loaded if r.experiment == "linear_delta_kl"]
    ppl = [f"{math.exp(sum(r.sequences['heldout/student']) / SEQS):.2f}" for r in delta]
    assert rows == [f"| pure linear: gated delta rule | 0 | {ppl[0]} | 4.00 | 2.60 |",
                    f"| pure linear: gated delta rule | 1 | {ppl[1]} | 5.00 | 2.60 |"]


def test_the_dof_table_gives_each_policys_layer_dof_and_its_features_over_the_budgets(tmp_path):
    for seed in range(2):
        fix = fake_run(tmp_path / "headline", f"fix_s{seed}", "linear_delta_kl", seed, 1.0)
        (fix / "allocation.json").write_text(json.dumps({"policy": "fix", "dims": [64, 64, 64], "budget": 64.0}))
        dof = fake_run(tmp_path / "dof", f"dof_s{seed}", "linear_delta_kl", seed, 0.9, policy="dof")
        (dof / "allocation.json").write_text(json.dumps(
            {"policy": "dof", "dims": [150 + seed, 30, 12], "budget": 64.0, "layer_dof": [15.0 + seed / 10, 3.0, 1.24]}))
    big = fake_run(tmp_path / "dof", "fix_max_s0", "linear_delta_kl", 0, 1.1, policy="fix_max")
    (big / "allocation.json").write_text(json.dumps({"policy": "fix_max", "dims": [150] * 3, "budget": 64.0,
                                                     "layer_dof": [15.0, 3.0, 1.24]}))
    for source in ("headline", "dof"):
        records.main([str(tmp_path / source), "--into", str(tmp_path / "records" / source)])
    table = results.PAGES["dof_allocation"](load_records(tmp_path / "records" / "dof"),
                                            load_records(tmp_path / "records" / "headline"), [])
    rows = {row.split(" | ")[0]: row.split(" | ") for row in table[("dof_allocation", "delta_main")].splitlines()[2:]}
    header = MAIN_HEADER
    cell = {policy: dict(zip(header, row)) for policy, row in rows.items()}
    assert (cell["| `fix`"]["layer 0's DoF"], cell["| `fix`"]["features ÷ `fix`'s"]) == ("–", "1.00×")
    assert (cell["| `dof`"]["layer 0's DoF"], cell["| `dof`"]["other layers' DoF"]) == ("15.0–15.1", "1.2–3.0")
    assert cell["| `dof`"]["features ÷ `fix`'s"] == f"{192 / 192:.2f}–{193 / 192:.2f}×"
    assert cell["| `fix_max`"]["features ÷ `fix`'s"] == f"{450 / 192:.2f}×"
    delta = float(cell["| `dof`"]["loss − teacher (nats)"].split(" ± ")[0])
    assert cell["| `dof`"]["× teacher"] == f"{math.exp(delta):.2f}×"
