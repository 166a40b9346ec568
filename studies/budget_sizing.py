"""Who should size the linear states: the measured values, the degrees of freedom, or one size for all?
(``docs/results/budget.md``)

``budget.state_sizing`` fixes who picks the M of each state the allocator keeps; the knapsack picks every
head's form (exact, window, window with a state) from the measured values under the same byte budget
(:mod:`dofla.dof.sizing`). Allocations of one teacher, menu, calibration, budget and estimate, solved with each
rule on the same measured menu, are set side by side: what each plan keeps, the value the knapsack predicted
for it, and its signals on the calibration text as its interaction check measured them (before any
training: the KL per token and the answer nats per passkey prompt). A second block asks the question under
the rule: over the KV heads, does a head's DoF rank the gain its state takes from the menu's largest M over
its smallest (Spearman's ρ, ``scipy.stats.spearmanr``)?
"""
from __future__ import annotations

from collections import Counter

from scipy.stats import spearmanr

from dofla.report import RunRecord
from studies.tables import KINDS, kind, markdown

ORDER = ("measured", "dof", "uniform")


def _states(allocation: dict) -> list[int]:
    """The state sizes the menu offers."""
    return sorted({int(o.rsplit("delta", 1)[1]) for o in allocation["menu"] if "delta" in o})


def _sizing(allocation: dict) -> str:
    return (allocation.get("state_sizing") or {}).get("name", "measured")


def sized_groups(allocations: list[RunRecord]) -> dict[tuple, dict[str, RunRecord]]:
    """Allocations whose menu offers several state sizes, grouped by budget, data order, estimate and menu,
    each group keyed by its sizing rule (the first record found of each)."""
    groups: dict[tuple, dict[str, RunRecord]] = {}
    for r in allocations:
        a = r.allocation
        if not a or not a.get("signals") or len(_states(a)) < 2:
            continue
        estimate = a.get("settings", {}).get("budget", {}).get("estimator", "measured")
        key = (round(a["budget"]["mib"], 6), r.seed, estimate, tuple(a["menu"]))
        groups.setdefault(key, {}).setdefault(_sizing(a), r)
    return groups


def _kept(allocation: dict) -> str:
    forms = Counter(kind(h["option"]) for h in allocation["heads"])
    return ", ".join(f"{form} {forms[form]}" for form in KINDS if forms[form])


def _sizes(allocation: dict) -> str:
    counts = Counter(h["plan"]["M"] for h in allocation["heads"] if h["plan"]["state"] != "none")
    return ", ".join(f"M={m} ×{counts[m]}" for m in sorted(counts)) or "none"


def _rule(allocation: dict) -> str:
    info = allocation.get("state_sizing") or {}
    if info.get("name") == "dof":
        return f"DoF (scale {info['scale']:.3g})"
    if info.get("name") == "uniform":
        return f"uniform (M={info['sizes'][0]})" if info.get("sizes") else "uniform"
    return "measured"


def sizing_table(allocations: list[RunRecord], label) -> str:
    """A row per sizing rule of each group with at least two rules (:func:`sized_groups`); ``label(record)``
    names the budget."""
    rows = []
    for (_, seed, estimate, _), found in sorted(sized_groups(allocations).items()):
        if len(found) < 2:
            continue
        for name in [n for n in ORDER if n in found]:
            r = found[name]
            a = r.allocation
            rows.append([label(r), str(seed), estimate.replace("_", " "), _rule(a), _kept(a), _sizes(a),
                         f"{a['plan_bytes'] / 2 ** 20:.1f}", f"{a['interaction']['predicted_value']:.3f}",
                         f"{a['interaction']['measured_value']:.3f}", f"{a['interaction']['kl']:.3f}",
                         f"{a['interaction']['nll']:.2f}"])
    header = ["budget at 8,192 tokens", "data order", "menu values", "who sizes the states", "KV heads kept",
              "states by size", "plan (MiB)", "predicted value", "measured value (calibration)",
              "calibration KL per token", "calibration answer nats"]
    return markdown(header, rows) if rows else ""


def state_gains(allocation: dict) -> dict[str, list[float]]:
    """Each unit's gain in both signals from the menu's largest state over its smallest, with the first window
    that offers states (KL per token and answer nats: positive where the larger state does better)."""
    states = _states(allocation)
    menu = allocation["menu"]
    window = next(o.split("+delta")[0] for o in menu if "+delta" in o)
    small, large = menu.index(f"{window}+delta{states[0]}"), menu.index(f"{window}+delta{states[-1]}")
    return {signal: [s[small][signal] - s[large][signal] for s in allocation["signals"]] for signal in ("kl", "nll")}


def sizing_dof_table(allocations: list[RunRecord], label) -> str:
    """A row per group whose DoF-sized allocation records each unit's DoF: Spearman's ρ (and p) between a unit's
    DoF and its gain from the largest state over the smallest, per signal."""
    rows = []
    for (_, seed, estimate, menu), found in sorted(sized_groups(allocations).items()):
        r = found.get("dof")
        if r is None or not r.allocation["state_sizing"].get("unit_dof"):
            continue
        a = r.allocation
        dof, gains, states = a["state_sizing"]["unit_dof"], state_gains(a), _states(a)
        cells = []
        for signal, name in (("kl", "KL"), ("nll", "answer NLL")):
            rho, p = spearmanr(dof, gains[signal])
            cells.append(f"{rho:+.2f} (p = {p:.2g})")
        rows.append([label(r), str(seed), estimate.replace("_", " "), f"M={states[-1]} over M={states[0]}",
                     str(len(dof)), f"{min(dof):.1f}–{max(dof):.1f}", *cells])
    header = ["budget at 8,192 tokens", "data order", "menu values", "the state's gain", "units", "DoF range",
              "Spearman's ρ with DoF: KL gain", "Spearman's ρ with DoF: answer-NLL gain"]
    return markdown(header, rows) if rows else ""
