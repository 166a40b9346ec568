"""benchmarks.bench_plan_student builds the plan a committed allocation record chose, and the same plan with
its exact heads at the baseline option (the non-exact heads whose decoding must be flat)."""
from __future__ import annotations

import json

from benchmarks.bench_plan_student import ALLOCATION, plans
from dofla.dof.menu import label


def test_the_plans_are_the_records_with_and_without_its_exact_heads():
    allocation = json.loads(ALLOCATION.read_text())
    plan, windows = plans(allocation)
    chosen = [h["option"] for h in allocation["heads"]]  # in (layer, KV head) order
    assert [label(h) for layer in plan.layers for h in layer] == chosen
    assert plan.state_bytes(3, 64, allocation["budget"]["context"]) == allocation["plan_bytes"]  # SmolLM2: 9/3 heads
    assert sum(h.exact for layer in plan.layers for h in layer) == chosen.count("exact") > 0
    assert not any(h.exact for layer in windows.layers for h in layer)
    pairs = [(a, b) for la, lb in zip(plan.layers, windows.layers) for a, b in zip(la, lb)]
    assert all(b == a if not a.exact else label(b) == allocation["baseline"] for a, b in pairs)
