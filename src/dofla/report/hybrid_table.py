"""``dofla-report --table hybrid``: trained hybrids over seeds against a training-free baseline run.

``dofla-report --table hybrid multirun_sweeps/hybrid_seeds --baseline sw4``

Run directories are named ``ROW_sSEED`` (e.g. ``hyb4_out_s1``), each a finished run
(:func:`dofla.report.tables.load_run`). For every row it prints the mean over seeds with the half-width of the 95 %
Student-t interval (``dofla.report.stats.mean_ci``) of: held-out perplexity, the share of the
baseline→teacher gap in held-out loss the row closes, (L_base − L) / (L_base − L_teacher) (paired
by seed; a training-free baseline is deterministic, so its one run serves every seed; ``--teacher
ROW`` puts a row, e.g. the teacher with the same LoRA fine-tune, in the teacher's place), the loss the
linear part gains (``eval.ablate_linear``), and the mean attention error; then the loss by
position bucket (mean over seeds) and the recall probes of the runs that have them.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from dofla.report.stats import gap_closed, mean_ci
from dofla.report.tables import find_runs, load_run

RUN_NAME = re.compile(r"^(?P<row>.+)_s(?P<seed>\d+)$")


def load_rows(root: Path) -> dict[str, dict[int, dict]]:
    """{row: {seed: metrics}} for every finished run ``ROW_sSEED`` directly under ``root``."""
    rows: dict[str, dict[int, dict]] = {}
    for run_dir in find_runs(root):
        match = RUN_NAME.match(run_dir.name)
        metrics = load_run(run_dir)["metrics"]
        if match and run_dir.parent == Path(root) and metrics:
            rows.setdefault(match["row"], {})[int(match["seed"])] = metrics
    return rows


def fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    mean, half = mean_ci(values)
    return f"{mean:.{digits}g}" if half is None else f"{mean:.{digits}g} ± {half:.2g}"


def run_gap_closed(metrics: dict, base_loss: float, teacher_loss: float | None = None) -> float:
    """(L_base − L) / (L_base − L_teacher) of one run; L_teacher: the run's own teacher unless given."""
    teacher_loss = metrics["eval/teacher_loss"] if teacher_loss is None else teacher_loss
    return gap_closed(base_loss, metrics["eval/student_loss"], teacher_loss)


def row_loss(runs: dict[int, dict], seed: int) -> float:
    """A reference row's student loss at ``seed``, or its mean over seeds when it lacks that seed
    (a training-free row is deterministic: one run serves every seed)."""
    if seed in runs:
        return runs[seed]["eval/student_loss"]
    return sum(m["eval/student_loss"] for m in runs.values()) / len(runs)


def main_table(rows: dict[str, dict[int, dict]], baseline: str, teacher: str | None = None) -> str:
    """``teacher``: a row standing in for the teacher (e.g. the teacher with the same fine-tune),
    paired by seed like ``baseline``; None: each run's own teacher."""
    base = next(iter(rows[baseline].values()))
    top = "the teacher" if teacher is None else f"`{teacher}`"
    lines = [f"| row | seeds | held-out ppl | gap `{baseline}` → {top} closed (loss) | linear part removed: ppl "
             "| loss the linear part gains (nats) | mean attention error |", "|---|---|---|---|---|---|---|",
             f"| teacher | – | {base['eval/teacher_ppl']:.2f} | – | – | – | – |"]
    for name, runs in rows.items():
        seeds = sorted(runs)
        ms = [runs[s] for s in seeds]
        gaps = [100 * run_gap_closed(runs[s], row_loss(rows[baseline], s), None if teacher is None else
                                 row_loss(rows[teacher], s)) for s in seeds]
        gains = [m["ablate/student_loss"] - m["eval/student_loss"] for m in ms if "ablate/student_loss" in m]
        lines.append(f"| {name} | {','.join(map(str, sorted(runs)))} | {fmt([m['eval/student_ppl'] for m in ms], 4)} "
                     f"| {fmt(gaps, 3)} % | {fmt([m['ablate/student_ppl'] for m in ms if 'ablate/student_ppl' in m], 4)} "
                     f"| {fmt(gains, 2)} | {fmt([m['eval/attn_error/mean'] for m in ms])} |")
    return "\n".join(lines)


def bucket_key(bucket: str) -> int:
    return int(bucket.split("-")[0])


def position_table(rows: dict[str, dict[int, dict]]) -> str:
    some = next(m for runs in rows.values() for m in runs.values())
    buckets = sorted({k.split("/")[2] for k in some if k.startswith("position/teacher/")}, key=bucket_key)
    if not buckets:
        return ""
    lines = ["| position | teacher | " + " | ".join(rows) + " |", "|---" * (len(rows) + 2) + "|"]
    for b in buckets:
        teacher = math.exp(some[f"position/teacher/{b}"])
        cells = []
        for runs in rows.values():
            losses = [m[f"position/student/{b}"] for m in runs.values() if f"position/student/{b}" in m]
            ppl = math.exp(sum(losses) / len(losses)) if losses else float("nan")
            cells.append(f"{ppl:.2f} ({ppl / teacher:.2f}×)")
        lines.append(f"| [{b.replace('-', ', ')}) | {teacher:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_table(rows: dict[str, dict[int, dict]]) -> str:
    probed = {name: m for name, runs in rows.items() for m in runs.values() if any(k.startswith("passkey/") for k in m)}
    if not probed:
        return ""
    some = next(iter(probed.values()))
    probes = ("passkey/student/", "passkey_nll/student/", "mqar/student/")
    keys = sorted((k.split("/", 2)[::2] for k in some if k.startswith(probes)),
                  key=lambda pk: (pk[0], int(pk[1][1:])))
    lines = ["| probe | teacher | " + " | ".join(probed) + " |", "|---" * (len(probed) + 2) + "|"]
    for probe, length in keys:
        cells = [f"{m.get(f'{probe}/student/{length}', float('nan')):.2f}" for m in probed.values()]
        lines.append(f"| {probe} {length} | {some[f'{probe}/teacher/{length}']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="dofla-report --table hybrid", description=__doc__.split("\n")[0])
    parser.add_argument("root", help="directory of ROW_sSEED run directories")
    parser.add_argument("--baseline", default="sw4", help="the row the gap is measured from")
    parser.add_argument("--teacher", default=None,
                        help="a row that stands in for the teacher (default: each run's own teacher)")
    args = parser.parse_args(argv)
    rows = load_rows(Path(args.root))
    for option, row in (("--baseline", args.baseline), ("--teacher", args.teacher)):
        if row is not None and row not in rows:
            raise SystemExit(f"no finished run {row}_s0 (or other seed) under {args.root}; "
                             f"name the row with {option}")
    print(main_table(rows, args.baseline, args.teacher))
    for text in (position_table(rows), probe_table(rows)):
        if text:
            print("\n" + text)

