"""studies.budget_sizing: the sizing rules' plans side by side on one measured menu, and DoF against the gain a
head takes from a larger state."""
from __future__ import annotations

import pytest
from scipy.stats import spearmanr

from dofla.report import RunRecord
from studies.budget_sizing import sizing_dof_table, sizing_table, state_gains

MENU = ["exact", "w64+s4", "w64+s4+delta32", "w64+s4+delta256"]
PLANS = {"exact": {"window": "all", "state": "none", "M": 0}, "w64+s4": {"window": 64, "state": "none", "M": 0},
         "w64+s4+delta32": {"window": 64, "state": "delta", "M": 32},
         "w64+s4+delta256": {"window": 64, "state": "delta", "M": 256}}
DOF = [2.0, 15.0, 4.0, 6.5]


def record(sizing: str, options: list[str], seed: int = 0, menu=MENU, kl: float = 0.1) -> RunRecord:
    base = {"kl": 1.0, "nll": 10.0}
    # the large state's KL gain over the small one grows with the head's DoF; its NLL gain falls
    signals = [[base, base, {"kl": 0.9, "nll": 9.0}, {"kl": 0.9 - d / 100, "nll": 9.0 + d / 10}][:len(menu)]
               for d in DOF]
    info = {"name": sizing, "unit_dof": DOF if sizing == "dof" else None, "scale": 4.0 if sizing == "dof" else None,
            "sizes": [32] * 4 if sizing == "uniform" else None, "candidates": []}
    allocation = {"menu": menu, "signals": signals, "base_signals": base, "state_sizing": info,
                  "budget": {"mib": 36.0}, "plan_bytes": 35.5 * 2 ** 20,
                  "heads": [{"option": o, "plan": PLANS[o]} for o in options],
                  "interaction": {"predicted_value": 1.25, "measured_value": 1.0, "kl": kl, "nll": 6.5},
                  "settings": {"budget": {"estimator": "first_order"}}}
    return RunRecord(f"sizing_{sizing}_s{seed}", {"seed": seed}, {}, {}, allocation)


def label(r: RunRecord) -> str:
    return "0.1 of the teacher's"


def test_each_rules_plan_is_a_row_in_rule_order_with_what_it_keeps():
    records = [record("uniform", ["w64+s4+delta32"] * 3 + ["exact"], kl=0.3),
               record("measured", ["exact", "w64+s4+delta256", "w64+s4", "w64+s4+delta32"]),
               record("dof", ["w64+s4+delta32", "w64+s4+delta256", "w64+s4+delta32", "w64+s4"], kl=0.2)]
    rows = [line for line in sizing_table(records, label).splitlines() if line.startswith("| 0.1")]
    assert [row.split(" | ")[3] for row in rows] == ["measured", "DoF (scale 4)", "uniform (M=32)"]
    assert "exact 1, window 1, window + state 2 | M=32 ×1, M=256 ×1" in rows[0]
    assert "window 1, window + state 3 | M=32 ×2, M=256 ×1" in rows[1]
    assert "exact 1, window + state 3 | M=32 ×3" in rows[2]
    assert [row.split(" | ")[9] for row in rows] == ["0.100", "0.200", "0.300"]
    assert rows[0].split(" | ")[2] == "first order"


def test_a_lone_rule_or_a_menu_of_one_state_is_no_comparison():
    assert sizing_table([record("dof", ["w64+s4"] * 4)], label) == ""
    one = MENU[:3]
    assert sizing_table([record("dof", ["w64+s4"] * 4, menu=one), record("measured", ["w64+s4"] * 4, menu=one)],
                        label) == ""


def test_the_dof_rho_is_scipys_over_the_units_gain_from_the_largest_state():
    a = record("dof", ["w64+s4"] * 4).allocation
    gains = state_gains(a)
    assert gains["kl"] == pytest.approx([d / 100 for d in DOF]) and gains["nll"] == pytest.approx([-d / 10 for d in DOF])
    table = sizing_dof_table([record("dof", ["w64+s4"] * 4), record("measured", ["w64+s4"] * 4)], label)
    row = next(line for line in table.splitlines() if line.startswith("| 0.1"))
    rho, p = spearmanr(DOF, gains["kl"])
    assert f"{rho:+.2f} (p = {p:.2g})" in row and "+1.00" in row and "-1.00" in row
    assert "M=256 over M=32 | 4 | 2.0–15.0" in row
