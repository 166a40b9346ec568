"""studies.budget_dof: a KV head's DoF (its query heads' mean) ranked against the gains the allocator measured."""
from __future__ import annotations

import random

from scipy.stats import spearmanr

from dofla.report import RunRecord
from studies.budget_dof import dof_table, kv_head_dof

LAYERS, KV, GROUP = 4, 2, 3
MENU = ["exact", "w64+s4", "w64+s4+delta64"]


def allocated(seed: int, kl_gain: list[float], nll_gain: list[float], estimator: str = "measured") -> RunRecord:
    base = {"kl": 1.0, "nll": 10.0}
    signals = [[{"kl": 1.0 - k, "nll": 10.0 - n}, base, {"kl": 1.0 - k / 2, "nll": 10.0 + n}]
               for k, n in zip(kl_gain, nll_gain)]
    heads = [{"layer": i, "kv_head": j} for i in range(LAYERS) for j in range(KV)]
    allocation = {"granularity": "head", "menu": MENU, "baseline": "w64+s4", "base_signals": base,
                  "signals": signals, "heads": heads, "settings": {"budget": {"estimator": estimator}}}
    return RunRecord(f"share0.1_s{seed}", {"seed": seed}, {}, {}, allocation)


def dof_run(seed: int, per_head: list[list[float]]) -> RunRecord:
    return RunRecord(f"dof_s{seed}", {"seed": seed}, {}, {}, None, {"per_head": per_head, "layer_dof": []})


def test_a_kv_heads_dof_is_the_mean_of_the_query_heads_that_read_it():
    per_head = [[1, 2, 3, 10, 20, 30], [0, 0, 3, 6, 6, 6]]
    assert kv_head_dof({"per_head": per_head}, KV) == [2, 20, 1, 6]


def test_rho_and_p_are_scipys_over_the_kv_heads_per_option_and_signal():
    rng = random.Random(0)
    per_head = [[rng.uniform(1, 40) for _ in range(KV * GROUP)] for _ in range(LAYERS)]
    dof = kv_head_dof({"per_head": per_head}, KV)
    kl = [2 * d for d in dof]  # ranked as DoF ranks the heads: ρ = +1
    nll = [rng.uniform(-1, 1) for _ in dof]
    table = dof_table([allocated(0, kl, nll), allocated(1, kl, nll)], [dof_run(0, per_head)])
    rows = {r.split(" | ")[0].lstrip("| "): r for r in table.splitlines()[2:]}
    assert set(rows) == {"exact: KL gain", "exact: answer NLL gain", "w64+s4+delta64: KL gain",
                         "w64+s4+delta64: answer NLL gain"}  # no row for the baseline; order 1 has no DoF
    assert "| 0 | 8 | +1.00 |" in rows["exact: KL gain"]
    rho, p = spearmanr(dof, nll)
    assert f"| {rho:+.2f} | {p:.2g} |" in rows["exact: answer NLL gain"]
    rho, p = spearmanr(dof, [-n for n in nll])  # the state option's NLL got worse by what exact gained
    assert f"| {rho:+.2f} | {p:.2g} |" in rows["w64+s4+delta64: answer NLL gain"]


def test_a_first_order_allocation_is_not_a_measurement():
    per_head = [[float(i + j) for j in range(KV * GROUP)] for i in range(LAYERS)]
    gains = [float(i) for i in range(LAYERS * KV)]
    assert dof_table([allocated(0, gains, gains, estimator="first_order")], [dof_run(0, per_head)]) == ""

