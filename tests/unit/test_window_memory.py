"""studies.window_memory restates a recorded student's decode memory as the current code holds it: a plain window
holds each KV head's keys and values once, where the records held them once per query head."""
from __future__ import annotations

from pathlib import Path

import pytest

from dofla.report import load_records
from dofla.models import StudentPlan
from studies.window_memory import RECORDED, restated, student_plan, window_memory_table, window_price_table

RUNS = Path(__file__).resolve().parents[2] / "docs" / "results" / "runs"
KEY = "memory/student/decode_mib/T8192"
PER_KV_POSITION = 2 * 64 * 4  # SmolLM2: one KV head's key and value of dim 64 in fp32


def _copies(plan, context: int = 8192) -> int:
    """Bytes the records held beyond the current code: two more copies (of three query heads) of each plain
    window's keys and values."""
    plain = [h for layer in plan.layers for h in layer if h.window and not h.exact and h.state == "none"]
    return 2 * sum((min(h.window - 1, context) + h.sinks) * PER_KV_POSITION for h in plain)


def test_the_window_preset_holds_a_third():
    runs = [r for r in load_records(RUNS / "headline") if r.experiment == "window_sinks_kl"]
    assert runs
    for run in runs:
        now = restated(run)
        # 30 layers × 3 KV heads, 63 window positions and 4 sinks each, and one flag per position per layer
        assert now.metrics[KEY] * 2**20 == 30 * (63 + 4) * (3 * PER_KV_POSITION + 1)
        assert now.metrics[RECORDED.format(8192)] == run.metrics[KEY]
        assert (run.metrics[KEY] - now.metrics[KEY]) * 2**20 == _copies(student_plan(run))


@pytest.mark.parametrize("page", ["budget", "budget_test"])
def test_an_allocated_plan_sheds_exactly_the_copies(page):
    runs = [r for r in load_records(RUNS / page) if r.allocation and "plan" in r.allocation]
    assert runs
    for run in runs:
        now = restated(run)
        shed = (run.metrics[KEY] - now.metrics[KEY]) * 2**20
        assert shed == pytest.approx(_copies(student_plan(run)), abs=1) and shed > 0


def test_a_student_without_a_plain_window_is_left_as_recorded():
    for preset in ("linear_delta_kl", "hybrid_delta", "hybrid_recall"):
        run = next(r for r in load_records(RUNS / "headline") if r.experiment == preset)
        assert student_plan(run) is None and restated(run) is run


def test_the_table_has_a_row_per_restated_student():
    records = load_records(RUNS / "headline") + load_records(RUNS / "budget")
    rows = window_memory_table(records).strip().splitlines()[2:]
    assert rows[0].startswith("| `window_sinks_kl` |") and rows[0].endswith("| 0.33 |")  # a third, as above
    assert len(rows) == 1 + len({round(r.allocation["budget"]["mib"], 6) for r in load_records(RUNS / "budget")})


def test_a_budget_solved_again_at_the_current_price_sits_beside_the_trained_one():
    allocations, trained = load_records(RUNS / "budget_alloc"), load_records(RUNS / "budget")
    now = next(r for r in allocations if r.name.startswith("window_price"))
    plan = StudentPlan.from_list(now.allocation["plan"])
    assert plan.state_bytes(3, 64, 8192) == now.allocation["plan_bytes"] <= now.allocation["budget"]["bytes"]
    rows = window_price_table(allocations, trained, lambda r: "budget").strip().splitlines()[2:]
    assert len(rows) == 2 and "priced per query head (trained)" in rows[0] and "priced per KV head" in rows[1]
    exact = [cells.split(" | ")[3] for cells in rows]
    assert int(exact[1]) == sum(h.exact for layer in plan.layers for h in layer)
