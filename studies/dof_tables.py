"""The DoF allocation page's generated blocks (``python -m studies.results dof_allocation``).

Two students, the best pure linear additive preset (``linear_hedgehog_kl``) and the gated delta-rule one
(``linear_delta_kl``), each under every allocation policy it ran: ``fix`` is the headline preset's own run
(its records are the headline page's), every other policy is the same command with ``allocation=<policy>``
(records in ``docs/results/runs/dof_allocation/``). Each data order (``seed``) trains its own layerwise
stage under each policy, so an interval over orders replicates the allocation, not only the KL stage; a
comparison pairs two policies by data order and by held-out sequence, and each order alone gives the
interval over its text. ``dof`` is the project's variant of Algorithm 1 (trace-normalised Gram matrix, λ = 10⁻²
of the trace, the mean of 16 J-samples, the mean over heads); Algorithm 1 in the paper's form is recorded as its
allocation alone (``docs/results/runs/algorithm1/``), beside the project's variant on the same data order.
"""
from __future__ import annotations

import math

from dofla.report import RunRecord
from studies.tables import common_orders, markdown, paired, quality, signed

PRESETS = {"linear_hedgehog_kl": "", "linear_delta_kl": "delta_"}  # preset -> its blocks' name prefix
POLICIES = ("fix", "dof", "dof_clip", "fix_max", "measured", "given")
MAIN_HEADER = ["policy", "command", "runs", "held-out ppl", "× teacher", "loss − teacher (nats)", "at positions 1,024–2,047",
               "layer 0's DoF", "other layers' DoF", "layer 0's features", "other layers' features", "features ÷ `fix`'s",
               "decode MiB @ 8K"]


def policy_arms(records: list[RunRecord], preset: str) -> dict[str, list[RunRecord]]:
    """The preset's runs of each policy that has any, by data order."""
    arms = {}
    for policy in POLICIES:
        runs = [r for r in records if r.experiment == preset and r.config.get("allocation", {}).get("policy") == policy]
        if runs:
            arms[policy] = sorted(runs, key=lambda r: r.seed)
    return arms


def span(numbers: list[float], digits: int = 0) -> str:
    low, high = min(numbers), max(numbers)
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else f"{low:.{digits}f}–{high:.{digits}f}"


def features(runs: list[RunRecord]) -> tuple[str, str, str]:
    """Layer 0's feature dimension, the other layers' range, and the features of all layers over the budget's
    (the budget C in every layer: what a `fix` run holds), over the runs (– without allocation.json)."""
    dims = [r.allocation["dims"] for r in runs if r.allocation]
    if not dims:
        return "–", "–", "–"
    budgets = [r.allocation.get("budget") for r in runs if r.allocation]
    ratio = span([sum(d) / (b * len(d)) for d, b in zip(dims, budgets)], 2) + "×" if None not in budgets else "–"
    return span([d[0] for d in dims]), span([m for d in dims for m in d[1:]]), ratio


def layer_dof(runs: list[RunRecord]) -> tuple[str, str]:
    """Layer 0's DoF and the other layers' range over the runs, as the allocating estimate gave them
    (– where it did not run: ``fix`` and ``given`` read no DoF)."""
    dof = [r.allocation["layer_dof"] for r in runs if r.allocation and r.allocation.get("layer_dof")]
    if not dof:
        return "–", "–"
    return span([d[0] for d in dof], 1), span([v for d in dof for v in d[1:]], 1)


def policy_row(preset: str, policy: str, runs: list[RunRecord]) -> list[str]:
    ppl, delta, far = quality(runs)
    memory = [r.metrics.get("memory/student/decode_mib/T8192") for r in runs]
    command = f"`experiment={preset}`" + ("" if policy == "fix" else f" `allocation={policy}`")
    return [f"`{policy}`", command, str(len(runs)), f"{ppl:.2f}", f"{math.exp(delta.mean):.2f}×", signed(delta), far,
            *layer_dof(runs), *features(runs), f"{memory[0]:.1f}" if None not in memory else "–"]


def preset_tables(preset: str, records: list[RunRecord]) -> tuple[str, str]:
    """One row per policy the preset ran, and each policy against ``fix`` (pooled over the data orders both
    ran, then each order alone); empty while none ran."""
    arms = policy_arms(records, preset)
    if not arms:
        return "", ""
    main = markdown(MAIN_HEADER, [policy_row(preset, p, runs) for p, runs in arms.items()])
    rows = []
    fix = arms.get("fix", [])
    for policy, runs in arms.items():
        orders = common_orders(runs, fix) if policy != "fix" else []
        for name, what in (("heldout/student", "held-out loss"), ("position/student/1024-2048", "positions 1,024–2,047")):
            rows += [[f"`{policy}` − `fix`, {what}", ", ".join(map(str, orders)), paired(runs, fix, name)]] if orders else []
        for order in orders if len(orders) > 1 else []:
            rows.append([f"`{policy}` − `fix`, held-out loss, order {order} alone", str(order),
                         paired([r for r in runs if r.seed == order], [r for r in fix if r.seed == order],
                                "heldout/student")])
    return main, markdown(["comparison", "data orders", "A − B (nats)"], rows) if rows else ""


def estimator(record: RunRecord) -> list[str]:
    """A DoF estimate's settings and what it gave, as cells: normalisation, λ, J, J-samples, heads' aggregate,
    each layer's DoF (layer 0, the others' range), and the dims (layer 0, the others)."""
    settings, allocation = record.config.get("allocation", {}), record.allocation
    dof, dims = allocation["layer_dof"], allocation["dims"]
    def setting(key: str) -> str:
        return str(settings[key]) if key in settings else "–"

    return [f"`{allocation['gram_norm']}`", f"{allocation['lambda']:g}", setting("num_samples"), setting("resamples"),
            f"`{setting('head_aggregate')}`", f"{dof[0]:.1f}", span(dof[1:], 1), str(dims[0]), span(dims[1:])]


def algorithm1_table(paper: list[RunRecord], runs: list[RunRecord]) -> str:
    """Algorithm 1 in the paper's form (allocation-only records) beside the project's variant on the
    same data order (the order's ``dof`` run of the delta student, or else of any preset)."""
    if not paper:
        return ""
    orders = {r.seed for r in paper}
    ours = sorted((r for r in runs if r.allocation and r.allocation.get("policy") == "dof" and r.seed in orders),
                  key=lambda r: (r.experiment != "linear_delta_kl", r.seed))[:1]
    header = ["estimator", "data order", "Gram normalisation", "λ", "J", "J-samples", "over heads",
              "layer 0's DoF", "other layers' DoF", "layer 0's features", "other layers' features"]
    rows = [["the project's variant (`allocation=dof`)", str(r.seed), *estimator(r)] for r in ours]
    rows += [["the paper's form", str(r.seed), *estimator(r)]
             for r in sorted(paper, key=lambda r: -r.allocation["lambda"])]
    return markdown(header, rows)


def dof_allocation(policies: list[RunRecord], headline: list[RunRecord],
                   algorithm1: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The page's blocks from the other policies' records, the headline's (``fix``) and the paper's form's
    allocation-only records: per student a row per policy and each policy against ``fix``."""
    blocks = {}
    for preset, prefix in PRESETS.items():
        main, comparisons = preset_tables(preset, policies + headline)
        blocks[("dof_allocation", f"{prefix}main")] = main
        blocks[("dof_allocation", f"{prefix}comparisons")] = comparisons
    blocks[("dof_allocation", "algorithm1")] = algorithm1_table(algorithm1, policies)
    return blocks
