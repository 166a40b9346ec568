"""studies.budget_weights: the knapsack solved again on a measured menu for a ladder of the signals' weights."""
from __future__ import annotations

import pytest

from dofla.dof.knapsack import brute_force
from dofla.report import RunRecord
from studies.budget_weights import option_sizes, weight_plans, weights_table

MENU = ["exact", "w64+s4", "w64+s4+delta64"]
SIZES = [100, 10, 20]
KV = 2


def allocation(kl_gain: list[float], nll_gain: list[float], budget: int, weights=(1.0, 1.0),
               estimator: str = "measured") -> dict:
    """Four KV heads: exact gains (kl_gain, nll_gain), the state option a tenth of each, the baseline none."""
    base = {"kl": 1.0, "nll": 10.0}
    signals = [[{"kl": 1.0 - k, "nll": 10.0 - n}, dict(base), {"kl": 1.0 - k / 10, "nll": 10.0 - n / 10}]
               for k, n in zip(kl_gain, nll_gain)]
    options = [1, 1, 2, 0]  # the record's plan: every option taken, so every option's bytes are known
    heads = [{"layer": h // KV, "kv_head": h % KV, "option": MENU[o], "bytes": SIZES[o]} for h, o in enumerate(options)]
    return {"granularity": "head", "menu": MENU, "baseline": "w64+s4", "base_signals": base, "signals": signals,
            "heads": heads, "budget": {"bytes": budget, "mib": budget / 2 ** 20, "given": {"share": 0.1}},
            "weights": {"kl": weights[0], "retrieval": weights[1]}, "settings": {"budget": {"estimator": estimator}}}


def test_each_weight_solves_to_the_brute_force_optimum_and_the_extremes_follow_their_signal():
    kl, nll = [0.01, 0.02, 0.0, 0.005], [3.0, 0.1, 0.2, 0.5]  # head 1 is KL's favourite, head 0 the retrieval's
    a = allocation(kl, nll, budget=130)
    plans = weight_plans(a, kl_weights=(0.0, 1.0, 10.0, 1000.0, None))
    for p in plans:
        values = [[p["kl_weight"] * (a["base_signals"]["kl"] - s["kl"]) + p["retrieval_weight"] *
                   (a["base_signals"]["nll"] - s["nll"]) for s in head] for head in a["signals"]]
        best = brute_force(values, [SIZES] * 4, 130)
        assert sum(values[h][o] for h, o in enumerate(p["options"])) == pytest.approx(best.value)
    assert plans[0]["exact"] == ["0.0"] and plans[-1]["exact"] == ["0.1"]
    assert plans[-1]["retrieval_weight"] == 0.0 and plans[-1]["kl_gain"] >= plans[0]["kl_gain"]
    assert plans[0]["nll_gain"] >= plans[-1]["nll_gain"]
    recorded = [MENU.index(h["option"]) for h in a["heads"]]
    assert plans[0]["moved"] == sum(o != r for o, r in zip(plans[0]["options"], recorded))


def test_the_table_takes_default_weight_measured_menus_at_the_ablations_budgets_only():
    kl, nll = [0.01, 0.02, 0.0, 0.005], [3.0, 0.1, 0.2, 0.5]
    mib = round(130 / 2 ** 20, 6)
    runs = [RunRecord("share0.1_s1", {"seed": 1}, {}, {}, allocation(kl, nll, 130)),
            RunRecord("share0.1_s0", {"seed": 0}, {}, {}, allocation(kl, nll, 130)),
            RunRecord("kl_s0", {"seed": 0}, {}, {}, allocation(kl, nll, 130, weights=(1.0, 0.0))),
            RunRecord("fo_s0", {"seed": 0}, {}, {}, allocation(kl, nll, 130, estimator="first_order")),
            RunRecord("other_s0", {"seed": 0}, {}, {}, allocation(kl, nll, 240))]
    table = weights_table(runs, {mib})
    rows = table.splitlines()[2:]
    assert len(rows) == 9 and all(r.startswith("| 0.1 of the teacher's, order 0 |") for r in rows)
    assert "| KL alone | 1 | 0.1 |" in rows[-1] and "| 0 | 1 | 0.0 |" in rows[0]
    assert weights_table(runs, {round(1 / 2 ** 20, 6)}) == ""


def test_an_option_no_head_took_has_no_bytes_on_record():
    a = allocation([0.0] * 4, [0.0] * 4, budget=130)
    for h in a["heads"]:
        h.update(option="w64+s4", bytes=10)
    assert option_sizes(a) is None
    with pytest.raises(ValueError, match="no head took"):
        weight_plans(a)
