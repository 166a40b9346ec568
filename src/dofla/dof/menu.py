"""The options each KV head chooses from under a memory budget, and what each costs in bytes.

The default menu (:class:`~dofla.dof.budget.MemoryBudgetConfig`): exact; a window of 64, 256 or 1,024 recent
tokens with 4 sinks, with no linear state or with a gated-delta state of M ∈ {32, 64, 128, 256} for the
tokens older than the window; a pure gated-delta state of each M. A head's bytes are its plan's
(:meth:`dofla.models.plan.HeadPlan.state_bytes` at the budget's context): the knapsack adds them head by
head. Heads of one structure decode as one kernel call and share a window's per-position flags, so the
plan's own count (:meth:`StudentPlan.state_bytes`) is at most the sum, never above it: a plan within the
summed budget is within the budget. :func:`reusable` says which options of a menu an earlier measurement holds.
"""
from __future__ import annotations

import math

from dofla.models.plan import ALL, HeadPlan, check_head


def default_menu(cfg) -> list[HeadPlan]:
    """The options of ``cfg`` (a MemoryBudgetConfig), one list for every KV head."""
    options = [HeadPlan(window=ALL)] if cfg.exact else []
    for window in cfg.windows:
        options.append(HeadPlan(window=window, sinks=cfg.sinks))
        options += [HeadPlan(window=window, sinks=cfg.sinks, state="delta", M=m) for m in cfg.states]
    if cfg.pure_states:
        options += [HeadPlan(state="delta", M=m) for m in cfg.states]
    return options


def label(option: HeadPlan) -> str:
    """A short readable name: ``exact``, ``w64+s4``, ``w64+s4+delta32``, ``delta128``."""
    if option.exact:
        return "exact"
    parts = [f"w{option.window}" + (f"+s{option.sinks}" if option.sinks else "")] if option.window else []
    if option.state != "none":
        parts.append(f"{option.state}{option.M}")
    return "+".join(parts)


def option_bytes(option: HeadPlan, geometry, context: int, kv_bytes: int = 4) -> int:
    """One KV head's decode state at ``context`` tokens under ``option`` (its query heads' group included)."""
    return option.state_bytes(geometry.num_heads // geometry.num_kv_heads, geometry.head_dim, context, kv_bytes)


def check_menu(menu: list[HeadPlan], geometry) -> None:
    """One sentence per option a head cannot take; and the baseline the others are measured against."""
    group = geometry.num_heads // geometry.num_kv_heads
    for i, option in enumerate(menu):
        check_head(option, group, f"menu option {i} ({label(option)})")
    if not any(option.state == "none" for option in menu):
        raise ValueError("the menu needs an option without a linear state (exact or a window) as the baseline the "
                         "others are measured against; add one")
    if len({label(option) for option in menu}) != len(menu):
        raise ValueError("the menu lists an option twice; list each once")


def baseline_index(menu: list[HeadPlan], geometry, context: int, kv_bytes: int = 4) -> int:
    """The cheapest option that needs no fitting (no linear state): every head starts there, and each other
    option is measured as one head switched to it (:mod:`dofla.dof.sensitivity`)."""
    free = [i for i, option in enumerate(menu) if option.state == "none"]
    return min(free, key=lambda i: (option_bytes(menu[i], geometry, context, kv_bytes), i))


def reusable(known: dict | None, menu: list, reference: dict) -> dict[int, int]:
    """The options of ``menu`` that ``known`` measured (by label) against the same baseline, whose signals
    ``reference`` are this measurement's: {index in ``menu``: index in ``known["menu"]``}; empty when ``known``
    is None or its baseline measured otherwise (another teacher, calibration or baseline option)."""
    if not known or not all(math.isclose(known["base"][s], reference[s], rel_tol=1e-4, abs_tol=1e-9)
                            for s in ("kl", "nll")):
        return {}
    there = {name: i for i, name in enumerate(known["menu"])}
    return {o: there[label(option)] for o, option in enumerate(menu) if label(option) in there}
