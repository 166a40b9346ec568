"""dofla.dof.sizing: who sizes the linear states. Each rule's solve against a brute force over every plan the
rule allows (every combination of options, each candidate's sizes checked plan by plan), and its errors."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from dofla.dof.budget import MemoryBudgetConfig
from dofla.dof.knapsack import solve
from dofla.dof.menu import default_menu
from dofla.dof.sizing import dof_scales, nearest_state, option_states, solve_sized

STATES = [4, 8, 16]
MENU = default_menu(MemoryBudgetConfig(mib=1, windows=[4], sinks=2, states=STATES, pure_states=True))
OPTION_M = option_states(MENU)  # exact, w4, w4+delta4/8/16, delta4/8/16


def instance(seed: int, units: int = 4):
    rng = random.Random(seed)
    values = [[rng.uniform(-1, 3) for _ in MENU] for _ in range(units)]
    # bytes: the exact option dearest, a state's bytes growing with its M, plus a head-dependent jitter
    sizes = [[100 if o == 0 else 10 + (m or 0) * 3 + rng.randrange(4) for o, m in enumerate(OPTION_M)]
             for _ in range(units)]
    budget = sum(min(s) for s in sizes) + rng.randrange(40, 200)
    return values, sizes, budget


def allowed_best(values, sizes, budget, fixed) -> float:
    """The plain reference: every plan whose units each keep no state or a state of their fixed M."""
    best = -math.inf
    for options in itertools.product(range(len(MENU)), repeat=len(values)):
        if any(OPTION_M[o] not in (None, fixed[u]) for u, o in enumerate(options)):
            continue
        if sum(s[o] for s, o in zip(sizes, options)) <= budget:
            best = max(best, sum(v[o] for v, o in zip(values, options)))
    return best


def test_the_nearest_state_is_nearest_on_a_log_scale():
    assert [nearest_state(x, [32, 64, 128]) for x in (1, 45.2, 45.3, 64, 90, 91, 1e6)] == [32, 32, 64, 64, 64, 128, 128]
    assert nearest_state(5, [64]) == 64


def test_measured_sizing_is_the_whole_menus_optimum():
    values, sizes, budget = instance(0)
    assert solve_sized(values, sizes, budget, MENU, "measured").choice == solve(values, sizes, budget)


@pytest.mark.parametrize("seed", range(4))
def test_uniform_sizing_is_the_best_plan_whose_states_share_one_m(seed):
    values, sizes, budget = instance(seed)
    sized = solve_sized(values, sizes, budget, MENU, "uniform")
    assert sized.choice.value == pytest.approx(max(allowed_best(values, sizes, budget, [m] * 4) for m in STATES))
    assert {OPTION_M[o] for o in sized.choice.options} - {None} <= {sized.sizes[0]} and len(set(sized.sizes)) == 1
    assert [c["M"] for c in sized.candidates] == STATES
    assert sized.choice.bytes <= budget


@pytest.mark.parametrize("seed", range(4))
def test_dof_sizing_is_the_best_plan_over_every_scale_of_the_dof(seed):
    values, sizes, budget = instance(seed)
    dof = [random.Random(seed).uniform(1, 30) for _ in values]
    sized = solve_sized(values, sizes, budget, MENU, "dof", dof)
    # the reference: a dense grid of scales, each one's sizes solved by brute force
    grid = {tuple(nearest_state(s * d, STATES) for d in dof) for s in (1.02 ** k / 1e3 for k in range(1200))}
    assert sized.choice.value == pytest.approx(max(allowed_best(values, sizes, budget, f) for f in grid))
    assert sized.sizes == tuple(nearest_state(sized.scale * d, STATES) for d in dof)
    assert all(OPTION_M[o] in (None, m) for o, m in zip(sized.choice.options, sized.sizes))
    assert max(c["value"] for c in sized.candidates) == pytest.approx(sized.choice.value)


def test_the_dof_scales_reach_every_sizing_a_scale_can_give():
    dof = [1.0, 2.5, 7.0, 7.0, 30.0]
    dense = {tuple(nearest_state(1.01 ** k / 1e3 * d, STATES) for d in dof) for k in range(2000)}
    reached = {tuple(nearest_state(s * d, STATES) for d in dof) for s in dof_scales(dof, STATES)}
    # 5 units × 2 thresholds, the two units of DoF 7.0 sharing theirs: 8 edges, 9 stretches
    assert reached == dense and len(dense) == 9


def test_a_larger_dof_never_gets_a_smaller_state():
    values, sizes, budget = instance(5, units=5)
    dof = [3.0, 1.0, 12.0, 6.0, 2.0]
    sized = solve_sized(values, sizes, budget, MENU, "dof", dof)
    order = sorted(range(5), key=lambda u: dof[u])
    assert [sized.sizes[u] for u in order] == sorted(sized.sizes)


def test_errors_are_one_sentence():
    values, sizes, budget = instance(0)
    with pytest.raises(ValueError, match="state_sizing=dof needs each unit's degrees of freedom"):
        solve_sized(values, sizes, budget, MENU, "dof")
    with pytest.raises(ValueError, match="one positive DoF per unit"):
        solve_sized(values, sizes, budget, MENU, "dof", [1.0, 0.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="must be one of measured, dof, uniform"):
        solve_sized(values, sizes, budget, MENU, "largest")
    windows = default_menu(MemoryBudgetConfig(mib=1, windows=[4], states=[]))
    with pytest.raises(ValueError, match="the menu offers none"):
        solve_sized([[0, 0]], [[2, 1]], 2, windows, "uniform")
    with pytest.raises(ValueError, match="state_sizing='largest' must be 'measured'"):
        MemoryBudgetConfig(mib=1, state_sizing="largest")
    with pytest.raises(ValueError, match="solver=random draws the plan"):
        MemoryBudgetConfig(mib=1, solver="random", state_sizing="uniform")


def test_a_budget_no_candidate_fits_is_one_sentence():
    # every state cheaper than the one stateless option: the whole menu fits, no fixed size does
    menu = default_menu(MemoryBudgetConfig(mib=1, exact=False, windows=[4], states=[4, 8], pure_states=True))
    states = option_states(menu)  # w4, w4+delta4, w4+delta8, delta4, delta8
    assert states == [None, 4, 8, 4, 8]
    sizes = [[50, 60, 60, 5, 50], [50, 60, 60, 50, 5]]  # unit 0 cheap only at delta4, unit 1 only at delta8
    values = [[0.0] * len(menu)] * 2
    assert solve_sized(values, sizes, 10, menu, "measured").choice.bytes == 10
    with pytest.raises(ValueError, match="no candidate's cheapest plan fits the budget"):
        solve_sized(values, sizes, 10, menu, "uniform")
