"""The multiple-choice knapsack of a memory budget: exactly one option per KV head, the summed bytes within
the budget, the summed measured value as large as possible.

:func:`solve` is the exact fast path: a mixed-integer programme given to HiGHS through
``scipy.optimize.milp`` (one binary variable per head and option, one equality per head, one byte
constraint, no relative gap allowed). :func:`brute_force` is its plain reference: every combination,
for the small instances the tests compare them on. Bytes are integers, so a solution the solver accepts
within its tolerance is checked against the budget exactly. :func:`random_choice` is the ablation's plan:
options drawn at random within the budget, no measured value consulted.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

MIB = 2 ** 20


@dataclass(frozen=True)
class Choice:
    """One option index per head, its summed value and bytes, and the solver's word on it."""

    options: tuple[int, ...]
    value: float
    bytes: int
    status: str


def check_instance(values: list[list[float]], sizes: list[list[int]], budget: int) -> None:
    """One sentence per malformed instance, and the budget below the cheapest plan."""
    if len(values) != len(sizes) or any(len(v) != len(s) or not v for v, s in zip(values, sizes)):
        raise ValueError("every head needs as many measured values as option sizes, and at least one option")
    cheapest = sum(min(s) for s in sizes)
    if cheapest > budget:
        raise ValueError(f"the budget of {budget / MIB:.3f} MiB is below the cheapest plan's {cheapest / MIB:.3f} MiB "
                         "(every head at its smallest option); raise the budget or add cheaper options to the menu")


def solve(values: list[list[float]], sizes: list[list[int]], budget: int) -> Choice:
    """The exact optimum: ``values[h][o]`` and ``sizes[h][o]`` (bytes) of option o at head h, ``budget`` bytes."""
    check_instance(values, sizes, budget)
    heads = len(values)
    offsets = np.cumsum([0] + [len(v) for v in values])
    n = int(offsets[-1])
    value = np.concatenate([np.asarray(v, dtype=float) for v in values])
    size = np.concatenate([np.asarray(s, dtype=float) for s in sizes])
    one = np.zeros((heads, n))
    for h in range(heads):
        one[h, offsets[h]:offsets[h + 1]] = 1.0
    constraints = [LinearConstraint(one, 1.0, 1.0), LinearConstraint(size[None, :], -np.inf, float(budget))]
    result = milp(-value, constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1),
                  options={"mip_rel_gap": 0.0})
    if result.x is None:
        raise RuntimeError(f"the knapsack solver found no plan ({result.message}); report it with the instance")
    picked = np.round(result.x).astype(int)
    options = tuple(int(np.argmax(picked[offsets[h]:offsets[h + 1]])) for h in range(heads))
    return _choice(values, sizes, budget, options, "optimal" if result.status == 0 else result.message)


def brute_force(values: list[list[float]], sizes: list[list[int]], budget: int) -> Choice:
    """The plain reference: every combination of options, the best within the budget (first of ties)."""
    check_instance(values, sizes, budget)
    best = None
    for options in itertools.product(*(range(len(v)) for v in values)):
        if sum(s[o] for s, o in zip(sizes, options)) > budget:
            continue
        total = sum(v[o] for v, o in zip(values, options))
        if best is None or total > best[0]:
            best = (total, options)
    return _choice(values, sizes, budget, best[1], "optimal")


def random_choice(sizes: list[list[int]], budget: int, seed: int, target: int | None = None,
                  draws: int = 256) -> Choice:
    """A plan drawn at random within ``budget`` bytes, for the ablation that asks what measurement buys at the
    same bytes: each draw visits the heads in a random order and gives each an option drawn uniformly among
    those that leave every later head its cheapest option; of ``draws`` draws the one closest to ``target``
    bytes (default: the budget) is kept. Its value is 0: nothing was measured."""
    zeros = [[0.0] * len(s) for s in sizes]
    check_instance(zeros, sizes, budget)
    rng = np.random.default_rng(seed)
    cheapest = [min(s) for s in sizes]
    target = budget if target is None else min(target, budget)
    best = None
    for _ in range(draws):
        options, left, floor = [0] * len(sizes), budget, sum(cheapest)
        for h in rng.permutation(len(sizes)):
            floor -= cheapest[h]  # what the heads after this one need at least
            fits = [o for o, size in enumerate(sizes[h]) if size <= left - floor]
            options[h] = int(rng.choice(fits))
            left -= sizes[h][options[h]]
        used = budget - left
        if best is None or abs(used - target) < abs(best[0] - target):
            best = (used, tuple(options))
    return _choice(zeros, sizes, budget, best[1], f"random (seed {seed}, {draws} draws)")


def _choice(values, sizes, budget, options, status) -> Choice:
    used = sum(int(s[o]) for s, o in zip(sizes, options))
    if used > budget:  # integers: the solver's tolerance must not buy bytes
        raise RuntimeError(f"the knapsack solver's plan takes {used} bytes over a budget of {budget}; report it")
    return Choice(tuple(options), float(sum(v[o] for v, o in zip(values, options))), used, status)
