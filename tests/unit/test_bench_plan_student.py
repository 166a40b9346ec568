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
    # SmolLM2: 9 query heads over 3 KV heads of dim 64. The record priced a window's keys and values once per query
    # head; the plan holds them once per KV head now: two copies fewer of a plain window's last W − 1 positions
    # (W before a state) and its sinks, everything else the same.
    context = allocation["budget"]["context"]
    windowed = [h for layer in plan.layers for h in layer if h.window and not h.exact]
    held = lambda h: min(h.window - (h.state == "none"), context)  # noqa: E731
    copies = (3 - 1) * sum((held(h) + h.sinks) * 2 * 64 * 4 for h in windowed)
    assert windowed and plan.state_bytes(3, 64, context) == allocation["plan_bytes"] - copies
    assert sum(h.exact for layer in plan.layers for h in layer) == chosen.count("exact") > 0
    assert not any(h.exact for layer in windows.layers for h in layer)
    pairs = [(a, b) for la, lb in zip(plan.layers, windows.layers) for a, b in zip(la, lb)]
    assert all(b == a if not a.exact else label(b) == allocation["baseline"] for a, b in pairs)
