"""Does a KV head's DoF say what the allocator's menu measured there? (``docs/results/budget.md``)

The allocator measures each option at each KV head (its gain in KL and in passkey-answer NLL over the
baseline, the window alone); Algorithm 1's DoF (the project's variant) is measured per query head without
training. If a head's DoF ranked the heads as the measured gains do, DoF could size or choose the states
instead of the measurement. The block gives Spearman's rank correlation (``scipy.stats.spearmanr``, with its
two-sided p) between the KV head's DoF (the mean over the query heads that read it) and each measured gain,
per data order where both were recorded (a measured menu, and a run whose dof stage ran on the same order).
"""
from __future__ import annotations

from scipy.stats import spearmanr

from dofla.report import RunRecord
from studies.tables import markdown

GAINS = (("KL", lambda base, s: base["kl"] - s["kl"]), ("answer NLL", lambda base, s: base["nll"] - s["nll"]))


def kv_head_dof(dof: dict, kv_heads: int) -> list[float]:
    """Each (layer, KV head)'s DoF in units order (layer by layer): the mean of its query heads' (query head
    i reads KV head i // group, as ``repeat_kv`` lays them out)."""
    out = []
    for heads in dof["per_head"]:
        group = len(heads) // kv_heads
        out += [sum(heads[j * group:(j + 1) * group]) / group for j in range(kv_heads)]
    return out


def measured_menus(records: list[RunRecord]) -> dict[int, RunRecord]:
    """One record per data order whose allocation measured its menu head by head (any budget: they share it)."""
    found = {}
    for r in records:
        a = r.allocation
        if a and a.get("granularity") == "head" and "signals" in a and \
                a["settings"]["budget"].get("estimator", "measured") == "measured":
            found.setdefault(r.seed, r)
    return found


def dof_table(allocated: list[RunRecord], dof_runs: list[RunRecord]) -> str:
    """A row per data order, option and signal: Spearman's ρ (and p) of the KV heads' DoF against the measured
    gain of that option over the baseline, with the heads counted."""
    dofs = {r.seed: r.dof for r in sorted(dof_runs, key=lambda r: r.name) if r.dof}
    rows = []
    for seed, r in sorted(measured_menus(allocated).items()):
        if seed not in dofs:
            continue
        a = r.allocation
        kv = 1 + max(h["kv_head"] for h in a["heads"])
        dof = kv_head_dof(dofs[seed], kv)
        for o, option in enumerate(a["menu"]):
            if option == a["baseline"]:
                continue
            for name, gain in GAINS:
                measured = [gain(a["base_signals"], head[o]) for head in a["signals"]]
                rho, p = spearmanr(dof, measured)
                rows.append([f"{option}: {name} gain", str(seed), str(len(measured)), f"{rho:+.2f}", f"{p:.2g}"])
    header = ["option (its gain over the baseline window alone)", "data order", "KV heads",
              "Spearman's ρ with the KV head's DoF", "p (two-sided)"]
    return markdown(header, rows) if rows else ""
