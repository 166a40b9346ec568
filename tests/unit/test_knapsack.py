"""The budget's knapsack: the MILP fast path against brute force on small random instances, and its edges."""
from __future__ import annotations

import random

import pytest

import itertools

from dofla.dof.knapsack import MIB, brute_force, random_choice, solve


def _instance(seed: int):
    rng = random.Random(seed)
    heads = rng.randint(1, 5)
    values = [[rng.uniform(-1, 3) for _ in range(rng.randint(1, 4))] for _ in range(heads)]
    sizes = [[rng.randint(1, 50) for _ in v] for v in values]
    cheapest, dearest = sum(min(s) for s in sizes), sum(max(s) for s in sizes)
    return values, sizes, rng.randint(cheapest, dearest)


@pytest.mark.parametrize("seed", range(60))
def test_the_solver_finds_the_brute_force_optimum(seed):
    values, sizes, budget = _instance(seed)
    fast, plain = solve(values, sizes, budget), brute_force(values, sizes, budget)
    assert fast.value == pytest.approx(plain.value, abs=1e-9)
    assert fast.bytes <= budget and fast.status == "optimal"
    assert len(fast.options) == len(values)
    assert fast.value == pytest.approx(sum(v[o] for v, o in zip(values, fast.options)), abs=1e-12)


def test_a_budget_on_the_byte_boundary_is_spent_exactly():
    values, sizes = [[0.0, 5.0], [0.0, 4.0], [0.0, 3.0]], [[1, 10], [1, 7], [1, 6]]
    choice = solve(values, sizes, 17)  # 10 + 6 + 1 = 17: heads 0 and 2 (8.0) beat heads 0 and 1 (18 bytes)
    assert choice.options == (1, 0, 1) and choice.bytes == 17 and choice.value == 8.0


def test_a_budget_below_the_cheapest_plan_is_one_sentence():
    with pytest.raises(ValueError, match=r"below the cheapest plan's .* MiB \(every head at its smallest option\)"):
        solve([[1.0, 2.0], [1.0]], [[MIB, 2 * MIB], [MIB]], 2 * MIB - 1)


def test_a_budget_above_everything_takes_each_heads_best_option():
    exact = 2  # the dearest and best-valued option of every head
    values = [[0.0, 0.4, 1.0], [0.0, 0.9, 2.0], [0.0, 0.1, 0.3]]
    sizes = [[3, 30, 300]] * 3
    assert solve(values, sizes, 10 ** 9).options == (exact,) * 3


def test_a_malformed_instance_is_one_sentence():
    with pytest.raises(ValueError, match="as many measured values as option sizes"):
        solve([[1.0, 2.0]], [[1]], 10)


@pytest.mark.parametrize("seed", range(20))
def test_a_random_plan_stays_within_the_budget_and_comes_close_to_its_target(seed):
    _, sizes, budget = _instance(seed)
    target = (sum(min(s) for s in sizes) + budget) // 2
    choice = random_choice(sizes, budget, seed=seed, target=target)
    assert choice.bytes <= budget and choice.value == 0.0 and choice.status.startswith("random")
    assert choice.bytes == sum(s[o] for s, o in zip(sizes, choice.options))
    # every byte count a plan within the budget can take: the draws find one as close as the best few
    reachable = sorted({sum(s[o] for s, o in zip(sizes, options))
                        for options in itertools.product(*(range(len(s)) for s in sizes))
                        if sum(s[o] for s, o in zip(sizes, options)) <= budget}, key=lambda b: abs(b - target))
    assert abs(choice.bytes - target) <= abs(reachable[min(2, len(reachable) - 1)] - target)


def test_random_plans_follow_their_seed():
    sizes = [[1, 4, 9]] * 12
    a, b, c = (random_choice(sizes, 60, seed=s, target=40) for s in (0, 0, 1))
    assert a == b and a.options != c.options
    assert len({o for o in a.options}) > 1  # a draw mixes options, it is not the cheapest plan
