"""studies.window_memory restates a recorded student's decode memory as the current code holds it: a window holds
each KV head's keys and values once, where the records held them once per query head."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dofla.models import StudentPlan
from dofla.report import load_records
from studies.window_memory import RECORDED, restated, student_plan, window_memory_table, window_price_table

RUNS = Path(__file__).resolve().parents[2] / "docs" / "results" / "runs"
KEY = "memory/student/decode_mib/T8192"
PER_KV_POSITION = 2 * 64 * 4  # SmolLM2: one KV head's key and value of dim 64 in fp32


def _copies(plan, context: int = 8192) -> int:
    """Bytes the records held beyond the current code: two more copies (of three query heads) of each window's
    keys and values, its last W − 1 positions for a plain window, W before a state, and its sinks."""
    windows = [h for layer in plan.layers for h in layer if h.window and not h.exact]
    held = lambda h: min(h.window - 1 if h.state == "none" else h.window, context)  # noqa: E731
    return 2 * sum((held(h) + h.sinks) * PER_KV_POSITION for h in windows)


def test_the_window_preset_holds_a_third():
    runs = [r for r in load_records(RUNS / "headline") if r.experiment == "window_sinks_kl"]
    assert runs
    for run in runs:
        now = restated(run)
        # 30 layers × 3 KV heads, 63 window positions and 4 sinks each, and one flag per position per layer
        assert now.metrics[KEY] * 2**20 == 30 * (63 + 4) * (3 * PER_KV_POSITION + 1)
        assert now.metrics[RECORDED.format(8192)] == run.metrics[KEY]


@pytest.mark.parametrize("page", ["headline", "budget", "budget_test", "dof_allocation"])
def test_every_windowed_student_sheds_exactly_the_copies(page):
    """The plan rebuilt from each record (its allocation's, or its config's conversion) accounts for the bytes the
    record measured: they exceed the current count by the window's extra copies, to the byte; a student without a
    window is left as recorded."""
    runs = load_records(RUNS / page)
    assert runs
    for run in runs:
        plan, now = student_plan(run), restated(run)
        if plan is None:
            assert now is run and not run.config["attention"].get("window")
            continue
        for key in [k for k in run.metrics if k.startswith("memory/student/decode_mib/T")]:
            context = int(key.rsplit("T", 1)[1])
            shed = (run.metrics[key] - now.metrics[key]) * 2**20
            assert shed == pytest.approx(_copies(plan, context), abs=1) and shed > 0, (run.name, key)


def test_a_student_without_a_window_or_of_another_teacher_is_left_as_recorded():
    for preset in ("linear_delta_kl", "linear_hedgehog_kl"):
        run = next(r for r in load_records(RUNS / "headline") if r.experiment == preset)
        assert student_plan(run) is None and restated(run) is run
    window = next(r for r in load_records(RUNS / "headline") if r.experiment == "window_sinks_kl")
    tiny = dataclasses.replace(window, config={**window.config, "model": {"name": "tiny_llama"}})
    assert student_plan(window) is not None and student_plan(tiny) is None and restated(tiny) is tiny


def test_the_table_has_a_row_per_restated_student():
    records = load_records(RUNS / "headline") + load_records(RUNS / "budget")
    rows = window_memory_table(records).strip().splitlines()[2:]
    assert rows[0].startswith("| `window_sinks_kl` |") and rows[0].endswith("| 0.33 |")  # a third, as above
    windowed = {r.experiment for r in load_records(RUNS / "headline") if r.config["attention"].get("window")}
    budgets = {round(r.allocation["budget"]["mib"], 6) for r in load_records(RUNS / "budget")}
    assert len(rows) == len(windowed) + len(budgets)


def test_a_budget_solved_again_at_the_current_price_sits_beside_the_trained_one():
    allocations, trained = load_records(RUNS / "budget_alloc"), load_records(RUNS / "budget")
    now = next(r for r in allocations if r.name.startswith("window_price"))
    plan = StudentPlan.from_list(now.allocation["plan"])
    assert plan.state_bytes(3, 64, 8192) == now.allocation["plan_bytes"] <= now.allocation["budget"]["bytes"]
    rows = window_price_table(allocations, trained, lambda r: "budget").strip().splitlines()[2:]
    assert len(rows) == 2 and "priced per query head (trained)" in rows[0] and "priced per KV head" in rows[1]
    exact = [cells.split(" | ")[3] for cells in rows]
    assert int(exact[1]) == sum(h.exact for layer in plan.layers for h in layer)
