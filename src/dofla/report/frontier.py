"""``dofla-report --table frontier DIR...``: quality against decode memory, one point per student.

Each student is a group of finished runs (run directories or run records) of one preset and
allocation policy (``experiment``; else one attention form and allocation). Its point: the held-out loss over its runs
and held-out sequences (mean and 95 % interval over both, :func:`dofla.report.crossed_interval`),
passkey recall at each measured length, and the decode memory of one sequence at each context the
runs measured (``eval.memory_contexts``: a layer kept exact grows with the context, a state does not).
The teacher is a point too. Writes ``frontier.md`` and ``frontier.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from dofla.report.intervals import crossed_interval
from dofla.report.plot_common import plt
from dofla.report.records import RunRecord, read_runs

MARKERS = "os^vD"
MEMORY = re.compile(r"^memory/(teacher|student)/decode_mib/T(\d+)$")


def student_label(record: RunRecord) -> str:
    """A group's name: the preset (with its allocation policy unless ``fix``: ``allocation=dof`` on a
    preset is another student; with its budget's MiB under ``allocation=budget``), or the attention
    form, window, exact layers and allocation."""
    c = record.config
    if record.experiment:
        policy = c.get("allocation", {}).get("policy", "fix")
        if policy == "budget" and record.allocation:  # a student per budget
            return f"{record.experiment} {record.allocation['budget']['mib']:.1f} MiB"
        return record.experiment if policy == "fix" else f"{record.experiment} {policy}"
    a, k = c["attention"], c["allocation"].get("softmax_layers", 0)
    window = f" w{a['window']}+{a['sinks']}" if a.get("window") else ""
    return f"{a['name']}{window}{f' {k} exact' if k else ''} {c['allocation']['policy']}"


def student_curve(record: RunRecord) -> str | None:
    """The curve a student's point joins: the allocator's students of one preset (``allocation=budget``), one point
    per budget, are one curve; every other student is a point of its own (None)."""
    if record.config.get("allocation", {}).get("policy") == "budget" and record.allocation:
        return f"{record.experiment or record.config['attention']['name']} (allocated)"
    return None


def point(name: str, runs: list[RunRecord], who: str) -> dict:
    """One student's (or the teacher's) numbers over its runs. The teacher's are the same in every run
    (the same text and prompts), so each of its measurements comes from the first run that took it: the
    runs of one preset may measure passkey at more lengths than another's."""
    def holding(key: str, where: str) -> list[RunRecord]:
        found = [r for r in runs if key in getattr(r, where)]
        return found if who == "student" else found[:1]

    losses = torch.tensor([r.sequences[f"heldout/{who}"] for r in runs], dtype=torch.float64)
    loss = crossed_interval(losses if who == "student" else losses[:1])
    keys = sorted({k for r in runs for k in r.sequences if k.startswith(f"passkey/{who}/T")})
    passkey = {int(k.rsplit("T", 1)[1]): sum(sum(r.sequences[k]) / len(r.sequences[k]) for r in rs) / len(rs)
               for k in keys if (rs := holding(k, "sequences"))}
    memory = {int(m[2]): holding(k, "metrics")[0].metrics[k] for k in sorted({k for r in runs for k in r.metrics})
              if (m := MEMORY.match(k)) and m[1] == who}
    return {"name": name, "runs": len(runs) if who == "student" else 0, "loss": loss, "passkey": passkey,
            "memory": memory, "curve": student_curve(runs[0]) if who == "student" else None}


def frontier_points(records: list[RunRecord]) -> list[dict]:
    """The teacher's point, then each student's, by decode memory at the longest context."""
    usable = [r for r in records if "heldout/student" in r.sequences]
    if not usable:
        raise SystemExit("no finished run with per-sequence held-out losses (eval_sequences.json) among the inputs")
    groups: dict[str, list[RunRecord]] = {}
    for record in sorted(usable, key=lambda r: r.seed):
        groups.setdefault(student_label(record), []).append(record)
    students = [point(name, runs, "student") for name, runs in groups.items()]
    longest = max((max(p["memory"]) for p in students if p["memory"]), default=None)
    students.sort(key=lambda p: p["memory"].get(longest, math.inf))
    return [point("teacher", usable, "teacher"), *students]


def frontier_table(points: list[dict]) -> str:
    contexts = sorted({c for p in points for c in p["memory"]})
    lengths = sorted({n for p in points for n in p["passkey"]})
    header = ["student", "runs", "held-out loss", "ppl", *[f"passkey @ {n}" for n in lengths],
              *[f"decode MiB @ {c}" for c in contexts]]
    rows = []
    for p in points:
        loss = p["loss"]
        rows.append([p["name"], str(p["runs"] or "–"), str(loss), f"{math.exp(loss.mean):.2f}",
                     *[f"{p['passkey'][n]:.2f}" if n in p["passkey"] else "–" for n in lengths],
                     *[f"{p['memory'][c]:.1f}" if c in p["memory"] else "–" for c in contexts]])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def frontier_series(points: list[dict]) -> dict[str, list[dict]]:
    """The plot's series, in the points' order: a student's point alone under its name, or every point of one
    curve (the allocator's students, one per budget) under the curve's name, joined in the plot."""
    series: dict[str, list[dict]] = {}
    for p in points:
        series.setdefault(p["curve"] or p["name"], []).append(p)
    return series


def frontier_plot(points: list[dict], path: Path) -> Path:
    """Held-out loss (top) and passkey recall (bottom) against decode memory, one column per context."""
    contexts = sorted({c for p in points for c in p["memory"]})
    if not contexts:
        raise SystemExit("the runs measured no decode memory: evaluate them with eval.memory_contexts=[2048,8192]")
    lengths = sorted({n for p in points for n in p["passkey"]})
    fig, axes = plt.subplots(2, len(contexts), figsize=(5.2 * len(contexts), 7), squeeze=False)
    # one colour per series (a student, or a curve of the allocator's students), the same in both panels:
    # matplotlib's ten while they suffice, else tab20's twenty
    series = frontier_series(points)
    palette = [f"C{i}" for i in range(10)] if len(series) <= 10 else [plt.get_cmap("tab20")(i) for i in range(20)]
    for col, context in enumerate(contexts):
        top, bottom = axes[0][col], axes[1][col]
        for i, (key, group) in enumerate(series.items()):
            members = sorted((p for p in group if context in p["memory"]), key=lambda p: p["memory"][context])
            if not members:
                continue
            xs, color = [p["memory"][context] for p in members], palette[i % len(palette)]
            top.errorbar(xs, [p["loss"].mean for p in members], yerr=[p["loss"].half_width or 0.0 for p in members],
                         fmt="o-" if len(members) > 1 else "o", capsize=3, color=color, label=key)
            for length in lengths:
                held = [(x, p["passkey"][length]) for x, p in zip(xs, members) if length in p["passkey"]]
                if held:
                    marker = MARKERS[lengths.index(length) % len(MARKERS)]
                    bottom.plot(*zip(*held), marker=marker, markersize=5, color=color,
                                linestyle="-" if len(held) > 1 else "none")
        top.legend(fontsize=7, loc="center", title="student", title_fontsize=7)  # points sit close: no labels
        for length in lengths:  # the legend: one marker per passkey length
            bottom.scatter([], [], marker=MARKERS[lengths.index(length) % len(MARKERS)], color="grey",
                           label=f"{length:,} tokens")
        if lengths:
            bottom.legend(fontsize=7, title="passkey length", title_fontsize=7, loc="center left")
        for ax, label in ((top, "held-out loss (nats)"), (bottom, "passkey recall (share of prompts)")):
            ax.set_xscale("log")
            ax.set_xlabel(f"decode memory per sequence at {context:,} tokens (MiB)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dofla-report --table frontier", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run directories, run records, or folders of them")
    parser.add_argument("--out", type=Path, default=Path("."), help="where frontier.md and frontier.png go")
    args = parser.parse_args(argv)
    points = frontier_points(read_runs(args.paths))
    table = frontier_table(points)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontier.md").write_text("# Quality against decode memory\n\n" + table)
    frontier_plot(points, args.out / "frontier.png")
    print(table, end="")
    print(f"dofla-report: wrote {args.out / 'frontier.md'} and {args.out / 'frontier.png'}")
