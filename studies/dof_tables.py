"""The DoF allocation page's generated blocks (``python -m studies.results dof_allocation``).

One student, the best pure linear additive preset (``linear_hedgehog_kl``), under each allocation policy:
``fix`` is the headline preset's own run (its records are the headline page's), every other policy is the
same command with ``allocation=<policy>`` (records in ``docs/results/runs/dof_allocation/``). Each data
order (``seed``) trains its own layerwise stage under each policy, so an interval over orders replicates
the allocation, not only the KL stage; a comparison pairs two policies by data order and by held-out
sequence, and each order alone gives the interval over its text.
"""
from __future__ import annotations

from dofla.report import RunRecord
from studies.tables import common_orders, markdown, paired, quality, signed

PRESET = "linear_hedgehog_kl"
POLICIES = ("fix", "dof", "dof_clip", "fix_max", "measured")
MAIN_HEADER = ["policy", "command", "runs", "held-out ppl", "loss − teacher (nats)", "at positions 1,024–2,047",
               "layer 0's features", "other layers' features", "decode MiB @ 8K"]


def policy_arms(records: list[RunRecord]) -> dict[str, list[RunRecord]]:
    """The preset's runs of each policy that has any, by data order."""
    arms = {}
    for policy in POLICIES:
        runs = [r for r in records if r.experiment == PRESET and r.config.get("allocation", {}).get("policy") == policy]
        if runs:
            arms[policy] = sorted(runs, key=lambda r: r.seed)
    return arms


def span(numbers: list[int]) -> str:
    low, high = min(numbers), max(numbers)
    return str(low) if low == high else f"{low}–{high}"


def features(runs: list[RunRecord]) -> tuple[str, str]:
    """Layer 0's feature dimension and the other layers' range, over the runs (– without allocation.json)."""
    dims = [r.allocation["dims"] for r in runs if r.allocation]
    if not dims:
        return "–", "–"
    return span([d[0] for d in dims]), span([m for d in dims for m in d[1:]])


def policy_row(policy: str, runs: list[RunRecord]) -> list[str]:
    ppl, delta, far = quality(runs)
    memory = [r.metrics.get("memory/student/decode_mib/T8192") for r in runs]
    command = f"`experiment={PRESET}`" + ("" if policy == "fix" else f" `allocation={policy}`")
    return [f"`{policy}`", command, str(len(runs)), f"{ppl:.2f}", signed(delta), far, *features(runs),
            f"{memory[0]:.1f}" if None not in memory else "–"]


def dof_allocation(policies: list[RunRecord], headline: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The page's blocks from the other policies' records and the headline's (``fix``): one row per policy,
    and each policy against ``fix`` (pooled over the data orders both ran, then each order alone)."""
    arms = policy_arms(policies + headline)
    if not arms:
        return {("dof_allocation", "main"): "", ("dof_allocation", "comparisons"): ""}
    main = markdown(MAIN_HEADER, [policy_row(p, runs) for p, runs in arms.items()])
    rows = []
    for policy, runs in arms.items():
        if policy == "fix":
            continue
        fix = arms.get("fix", [])
        orders = common_orders(runs, fix)
        for name, what in (("heldout/student", "held-out loss"), ("position/student/1024-2048", "positions 1,024–2,047")):
            rows.append([f"`{policy}` − `fix`, {what}", ", ".join(map(str, orders)), paired(runs, fix, name)])
        for order in orders if len(orders) > 1 else []:
            rows.append([f"`{policy}` − `fix`, held-out loss, order {order} alone", str(order),
                         paired([r for r in runs if r.seed == order], [r for r in fix if r.seed == order],
                                "heldout/student")])
    return {("dof_allocation", "main"): main,
            ("dof_allocation", "comparisons"): markdown(["comparison", "data orders", "A − B (nats)"], rows)}
