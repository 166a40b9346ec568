"""The tokens study's generated blocks: the pure linear students trained on more KL text.

``python -m studies.results dof_tokens`` (blocks on the DoF page) and ``python -m studies.results tokens_curve``
(blocks and figure on the headline page). The runs of ``studies/reproduce/dof_tokens.sh`` train each pure
student with ``distill.tokens`` above the headline's 65,536 and score it on both parts of the held-out text:
their dev records (``docs/results/runs/dof_tokens/``) sit beside the 65,536-token records, which were
scored on dev (``headline/`` for ``fix``, ``dof_allocation/`` for the other policies), so a row at each
token count reads the same text; their test records (``dof_tokens_test/``) are the answer on text no choice
has seen. A comparison pairs two policies by data order and held-out sequence, at one token count and split.
"""
from __future__ import annotations

import math
from pathlib import Path

from dofla.report import RunRecord, crossed_interval, paired_interval, share_interval
from studies.tables import common_orders, markdown, paired, quality, signed, teacher, values

PURE = (("pure linear: Hedgehog + decay gate", "linear_hedgehog_kl"), ("pure linear: gated delta rule", "linear_delta_kl"))
POLICIES = ("fix", "dof")
SPLITS = ("dev", "test")


def kl_tokens(record: RunRecord) -> int | None:
    tokens = record.config.get("distill", {}).get("tokens")
    return None if tokens is None else int(tokens)


def split(record: RunRecord) -> str:
    """The held-out part a record was scored on: records from before the split existed were scored on dev."""
    return record.config.get("data", {}).get("heldout_split") or "dev"


def policy(record: RunRecord) -> str:
    return record.config.get("allocation", {}).get("policy", "fix")


def groups(records: list[RunRecord]) -> dict[tuple[str, int, str, str], list[RunRecord]]:
    """The pure students' runs by (preset, KL tokens, split, policy), each group by data order."""
    found = {}
    for r in records:
        if r.experiment in dict(map(reversed, PURE)) and policy(r) in POLICIES and kl_tokens(r) \
                and "heldout/student" in r.sequences:
            found.setdefault((r.experiment, kl_tokens(r), split(r), policy(r)), []).append(r)
    order = {preset: i for i, (_, preset) in enumerate(PURE)}
    return {k: sorted(found[k], key=lambda r: r.seed)
            for k in sorted(found, key=lambda k: (order[k[0]], k[1], SPLITS.index(k[2]), POLICIES.index(k[3])))}


def tokens_table(found: dict) -> str:
    """A row per student, KL tokens, split and policy: held-out perplexity, its ratio to the teacher's and
    the loss gaps (95 % over runs and held-out text)."""
    rows = []
    for (preset, tokens, part, pol), runs in found.items():
        ppl, delta, far = quality(runs)
        rows.append([f"`{preset}`", f"{tokens:,}", part, f"`{pol}`", ", ".join(str(r.seed) for r in runs),
                     f"{ppl:.2f}", f"{math.exp(delta.mean):.2f}×", signed(delta), far, *agreement(runs)])
    header = ["student", "KL tokens", "held-out split", "policy", "data orders", "held-out ppl", "× teacher",
              "loss − teacher (nats)", "at positions 1,024–2,047", "first generated token = teacher's",
              "greedy tokens matched (of 32)"]
    return markdown(header, rows) if rows else ""


def agreement(runs: list[RunRecord]) -> tuple[str, str]:
    """The generation-scored agreement cells (– where not measured): the share of prompts whose first greedy
    token is the teacher's (Wilson's interval over the pooled prompts) and the mean matched prefix of the
    greedy continuations (95 % over runs and prompts)."""
    first, prefix = values(runs, "agreement/first_token"), values(runs, "agreement/prefix_len")
    if first is None or prefix is None:
        return "–", "–"
    got = share_interval(first)
    return f"{got} ({got.hits}/{got.trials})", signed(crossed_interval(prefix)).lstrip("+")


def comparisons(found: dict) -> str:
    """``dof`` − ``fix`` at each student, token count and split both policies ran: pooled over the data
    orders both ran, on the whole held-out loss and at positions 1,024–2,047; then, where several orders
    ran, each order alone on the held-out loss."""
    rows = []
    for (preset, tokens, part, pol), runs in found.items():
        fix = found.get((preset, tokens, part, "fix"))
        if pol == "fix" or not fix or not common_orders(runs, fix):
            continue
        both = common_orders(runs, fix)
        cells = [f"`{preset}`", f"{tokens:,}", part]
        for name, what in (("heldout/student", "held-out loss"), ("position/student/1024-2048", "positions 1,024–2,047")):
            rows.append([*cells, f"`{pol}` − `fix`, {what}", ", ".join(map(str, both)), paired(runs, fix, name)])
        for order in both if len(both) > 1 else []:
            rows.append([*cells, f"`{pol}` − `fix`, held-out loss, order {order} alone", str(order),
                         paired([r for r in runs if r.seed == order], [r for r in fix if r.seed == order],
                                "heldout/student")])
    return markdown(["student", "KL tokens", "held-out split", "comparison", "data orders", "A − B (nats)"], rows) if rows else ""


def dof_tokens(dev: list[RunRecord], test: list[RunRecord], headline: list[RunRecord],
               policies: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The DoF page's tokens blocks: every pure student's row at each KL token count and split, and ``dof``
    against ``fix`` where both ran."""
    found = groups([*headline, *policies, *dev, *test])
    longer = {k[0] for k in found if k[1] > 65536}  # a student's 65,536-token rows only beside a longer run
    more = {k: runs for k, runs in found.items() if k[0] in longer}
    return {("dof_tokens", "table"): tokens_table(more), ("dof_tokens", "comparisons"): comparisons(more)}


def curve(records: list[RunRecord]) -> list[dict]:
    """Each pure student's points under ``fix`` on dev: KL tokens, data orders, and its held-out perplexity
    over the teacher's with the 95 % interval of the loss gap (over runs and text) carried through exp."""
    points = []
    for (preset, tokens, part, pol), runs in groups(records).items():
        if pol != "fix" or part != "dev":
            continue
        delta = paired_interval(values(runs, "heldout/student"), teacher(runs, "heldout/teacher"))
        half = delta.half_width
        points.append({"preset": preset, "tokens": tokens, "orders": [r.seed for r in runs], "interval": delta,
                       "ratio": math.exp(delta.mean), "low": math.exp(delta.mean - half) if half else None,
                       "high": math.exp(delta.mean + half) if half else None})
    return points


def curve_table(points: list[dict]) -> str:
    rows = [[f"`{p['preset']}`", f"{p['tokens']:,}", ", ".join(map(str, p["orders"])), f"{p['ratio']:.2f}×",
             f"{p['low']:.2f}–{p['high']:.2f}×" if p["low"] else "–", p["interval"].counts] for p in points]
    header = ["student", "KL tokens", "data orders", "held-out ppl ÷ teacher's", "95 % interval", "interval counts"]
    return markdown(header, rows) if rows else ""


def tokens_curve(dev: list[RunRecord], headline: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The headline page's tokens block: the pure students' perplexity ratio at each KL token count (dev),
    shown only once a student has a point beyond the headline's 65,536 tokens."""
    points = curve([*headline, *dev])
    longer = {p["preset"] for p in points if p["tokens"] > 65536}
    return {("tokens_curve", "table"): curve_table([p for p in points if p["preset"] in longer])}


def tokens_figure(records: list[RunRecord], path: Path) -> Path | None:
    """The perplexity ratio against KL tokens (log scale) for each pure student with two points or more, the
    2× line drawn; None while none has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve(records)
    lines = {preset: [p for p in points if p["preset"] == preset] for _, preset in PURE}
    lines = {preset: line for preset, line in lines.items() if len(line) > 1}
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = dict(map(reversed, PURE))
    for preset, line in lines.items():
        x = [p["tokens"] for p in line]
        y = [p["ratio"] for p in line]
        err = [[p["ratio"] - (p["low"] or p["ratio"]) for p in line], [(p["high"] or p["ratio"]) - p["ratio"] for p in line]]
        ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=labels[preset])
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2× the teacher")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KL tokens (log scale)")
    ax.set_ylabel("held-out perplexity ÷ teacher's (dev)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
