"""How the knapsack sizes the linear states: freely by the measured values, by degrees of freedom, or alike.

The allocator's menu offers a linear state of several sizes M. ``state_sizing`` says who chooses a unit's M
(a unit: a KV head, or a layer under ``granularity=layer``); the knapsack still chooses every unit's form
(exact, window, window with a state, a state alone) by the measured values under the one byte budget:

- ``measured``: any M of the menu, the value's choice (the exact optimum of the whole menu);
- ``dof``: the paper's rule, M in proportion to the unit's degrees of freedom (Algorithm 1, the project's
  variant): the M of the menu nearest to s × DoF on a log scale, one scale s for all units. Which s spends
  the budget best is the measured values' choice: every scale that changes some unit's M is solved
  exactly and the best kept, so the rule is given its best showing;
- ``uniform``: one M for every state, each M of the menu solved exactly and the best kept.

A unit whose M is fixed keeps every option without a state, so each candidate's knapsack holds the cheapest
plan whenever the menu's cheapest options carry no state; a candidate whose own cheapest plan exceeds the
budget is skipped, and a budget no candidate fits is one sentence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dofla.dof.knapsack import Choice, solve

STATE_SIZINGS = ("measured", "dof", "uniform")


@dataclass(frozen=True)
class Sized:
    """The chosen plan, the candidate it came from (``scale`` for dof, ``M`` for uniform) and every
    candidate's best value (None where its cheapest plan exceeds the budget)."""

    choice: Choice
    sizes: tuple[int, ...] | None  # each unit's M; None for measured
    scale: float | None
    candidates: list[dict]


def option_states(menu: list) -> list[int | None]:
    """Each option's linear-state M (None: the option keeps no state)."""
    return [None if option.state == "none" else int(option.M) for option in menu]


def nearest_state(x: float, states: list[int]) -> int:
    """The M of ``states`` nearest to ``x`` on a log scale (ties to the larger): below the geometric mean of
    two neighbours the smaller one."""
    states = sorted(set(states))
    for small, large in zip(states, states[1:]):
        if x < math.sqrt(small * large):
            return small
    return states[-1]


def dof_scales(unit_dof: list[float], states: list[int]) -> list[float]:
    """One scale s inside each stretch where every unit's M (:func:`nearest_state` of s × DoF) stays the
    same: the midpoints between the sorted thresholds √(m_i m_{i+1}) / DoF, and one scale beyond each end."""
    states = sorted(set(states))
    edges = sorted({math.sqrt(a * b) / d for d in unit_dof for a, b in zip(states, states[1:])})
    if not edges:  # one state size, or every unit's DoF is the same and the sizes one: a single candidate
        return [1.0]
    return [edges[0] / 2] + [(a + b) / 2 for a, b in zip(edges, edges[1:])] + [edges[-1] * 2]


def check_sizing(sizing: str, states: list, unit_dof: list | None, units: int) -> None:
    """One sentence per user error, before any model runs."""
    if sizing not in STATE_SIZINGS:
        raise ValueError(f"state_sizing={sizing!r} must be one of {', '.join(STATE_SIZINGS)}")
    if sizing == "measured":
        return
    if not any(m is not None for m in states):
        raise ValueError(f"state_sizing={sizing} sizes linear states, and the menu offers none; give states or "
                         "use state_sizing=measured")
    if sizing == "dof":
        if unit_dof is None:
            raise ValueError("state_sizing=dof needs each unit's degrees of freedom (the dof stage's estimate); "
                             "run the dof stage with this allocation or use state_sizing=measured")
        if len(unit_dof) != units or any(not d > 0 for d in unit_dof):
            raise ValueError(f"state_sizing=dof needs one positive DoF per unit ({units}), got {len(unit_dof)} "
                             "values; estimate the DoF on the same teacher")


def solve_sized(values: list[list[float]], sizes: list[list[int]], budget: int, menu: list, sizing: str,
                unit_dof: list[float] | None = None) -> Sized:
    """The best plan under ``sizing`` (module docstring): the exact optimum over the whole menu for
    ``measured``, else the best of the candidates' exact optima with each unit's M fixed."""
    states = option_states(menu)
    check_sizing(sizing, states, unit_dof, len(values))
    if sizing == "measured":
        return Sized(solve(values, sizes, budget), None, None, [])
    offered = sorted({m for m in states if m is not None})
    if sizing == "uniform":
        candidates = [({"M": m}, [m] * len(values)) for m in offered]
    else:
        candidates, seen = [], set()
        for s in dof_scales(unit_dof, offered):
            fixed = tuple(nearest_state(s * d, offered) for d in unit_dof)
            if fixed not in seen:
                seen.add(fixed)
                candidates.append(({"scale": s}, list(fixed)))
    best, tried = None, []
    for about, fixed in candidates:
        allowed = [[o for o, m in enumerate(states) if m is None or m == fixed[u]] for u in range(len(values))]
        if sum(min(sizes[u][o] for o in allowed[u]) for u in range(len(values))) > budget:
            tried.append({**about, "value": None})
            continue
        sub = solve([[values[u][o] for o in a] for u, a in enumerate(allowed)],
                    [[sizes[u][o] for o in a] for u, a in enumerate(allowed)], budget)
        choice = Choice(tuple(allowed[u][o] for u, o in enumerate(sub.options)), sub.value, sub.bytes, sub.status)
        tried.append({**about, "value": choice.value})
        if best is None or choice.value > best[0].value:
            best = (choice, tuple(fixed), about.get("scale"))
    if best is None:
        raise ValueError(f"under state_sizing={sizing} no candidate's cheapest plan fits the budget of "
                         f"{budget / 2 ** 20:.3f} MiB; raise the budget or use state_sizing=measured")
    return Sized(best[0], best[1], best[2], tried)
