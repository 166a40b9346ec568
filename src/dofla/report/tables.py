"""Read run directories and compare them: report.md, report.csv and a printed table.

A run directory is any folder holding ``run.json`` (written by every run). A sweep directory is
any folder above several of them. Nothing here needs wandb.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dofla.config import RunConfig
from dofla.feature_maps.blocks import layer_mean_dim, mean_dim
from dofla.record import read_json
from dofla.report.plots import write_plots
from dofla.report.seed_tables import GROUP_CAPTION, PAIRED_CAPTION, csv_columns, group_rows, paired_rows
from dofla.report.seeds import distinguishing_overrides, paired_vs_fix, run_seed, seed_groups, twin_key

SUMMARY_METRICS = ("eval/teacher_ppl", "eval/student_ppl", "eval/ppl_ratio", "eval/attn_error/mean",
                   "tasks/teacher/avg_acc", "tasks/student/avg_acc", "tasks/acc_gap",
                   # the paper's protocol: each model fine-tuned per task, the average over the tasks run
                   "finetuned/teacher/avg_acc", "finetuned/student/avg_acc")
# Parts of the reproducibility record that should match across runs being compared.
RECORD_KEYS = ("git", "packages", "device", "cache_key")


def find_runs(root: Path) -> list[Path]:
    root = Path(root)
    if (root / "run.json").exists():
        return [root]
    return sorted(p.parent for p in root.rglob("run.json") if ".tmp" not in p.parent.name)


def load_run(run_dir: Path) -> dict:
    record = read_json(run_dir / "run.json") or {}
    return {
        "dir": run_dir,
        "record": record,
        "overrides": record.get("overrides", []),
        "metrics": read_json(run_dir / "metrics.json") or {},
        "allocation": read_json(run_dir / "allocation.json") or {},
        "dof": read_json(run_dir / "dof.json") or {},
        "timings": read_json(run_dir / "timings.json") or {},
        "train": read_json(run_dir / "train_summary.json") or {},
    }


def run_config(run_dir: Path):
    """The typed :class:`~dofla.config.RunConfig` a finished run ran with (its run.json); a run
    recorded before ``cache_dir`` moved into ``paths`` is read as such."""
    config = dict((read_json(Path(run_dir) / "run.json") or {}).get("config") or {})
    if not config:
        raise FileNotFoundError(f"{run_dir} holds no run.json with a config; point at a finished run's directory")
    if "cache_dir" in config:  # recorded before the paths group
        config.setdefault("paths", {})["cache_dir"] = config.pop("cache_dir")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), config))


def record_differences(runs: list[dict]) -> list[str]:
    """Sentences naming record fields (code, packages, device, cache) that differ across runs."""
    notes = []
    for key in RECORD_KEYS:
        seen = {repr(run["record"].get(key)) for run in runs}
        if len(seen) > 1:
            notes.append(f"runs differ in {key} (not only in their overrides): {sorted(seen)}")
    return notes


def record_differences_within_seeds(runs: list[dict]) -> list[str]:
    """Like ``record_differences``, but the cache key is compared only between runs of one seed
    (a tiny random model's weights, hence its activation cache, depend on the seed)."""
    notes = [n for n in record_differences(runs) if not n.startswith("runs differ in cache_key")]
    by_seed: dict = {}
    for run in runs:
        by_seed.setdefault(run_seed(run), []).append(run)
    if any(len({repr(r["record"].get("cache_key")) for r in same}) > 1 for same in by_seed.values()):
        notes += [n for n in record_differences(runs) if n.startswith("runs differ in cache_key")]
    return notes


def rows(runs: list[dict], root: Path, groups: list[dict] | None = None,
         paired: list[dict] | None = None) -> list[dict]:
    """One report.csv row per run: its distinguishing overrides, mean dim, metrics, timings and,
    given ``groups`` / ``paired``, its seed group's and paired-vs-fix statistics."""
    keys = distinguishing_overrides(runs)
    group_of = {id(r): g for g in groups or [] for r in g["runs"]}
    pair_of = {id(r): p for p in paired or [] for r in p["group"]["runs"]}
    out = []
    for run in runs:
        given = dict(o.partition("=")[::2] for o in run["overrides"])
        row = {"run": str(run["dir"].relative_to(root)) if run["dir"] != root else run["dir"].name}
        row.update({k: given.get(k, "<default>") for k in keys})
        dims = run["allocation"].get("dims")
        row["mean_dim"] = round(mean_dim(dims), 2) if dims else None
        row.update(run["metrics"])
        row.update(run["timings"])
        if groups is not None:
            row.update(csv_columns(run, group_of.get(id(run)), pair_of.get(id(run))))
        out.append(row)
    return out


def gap_closed(runs: list[dict]) -> list[dict]:
    """Per non-``fix`` run with a ``fix`` twin (same config but the policy): the fraction of the
    fix→teacher perplexity gap it closes, (ppl_fix − ppl) / (ppl_fix − ppl_teacher)."""
    fix = {}
    for run in runs:
        config = run["record"].get("config", {})
        if config.get("allocation", {}).get("policy") == "fix" and "eval/student_ppl" in run["metrics"]:
            fix[twin_key(config)] = run
    out = []
    for run in runs:
        config = run["record"].get("config", {})
        policy = config.get("allocation", {}).get("policy")
        twin = fix.get(twin_key(config)) if config else None
        m = run["metrics"]
        if policy in (None, "fix") or twin is None or "eval/student_ppl" not in m:
            continue
        ppl_fix, teacher = twin["metrics"]["eval/student_ppl"], m["eval/teacher_ppl"]
        gap = ppl_fix - teacher
        out.append({"run": run, "policy": policy, "fix_ppl": ppl_fix, "ppl": m["eval/student_ppl"],
                    "teacher_ppl": teacher, "gap_closed": (ppl_fix - m["eval/student_ppl"]) / gap if gap else None})
    return out


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown_table(table_rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in table_rows]
    return "\n".join(lines)


def write_report(root: Path, console: Console | None = None) -> Path:
    """Write report.md and report.csv in ``root`` comparing every run under it; print the tables.

    Runs that differ only in their seed are summarised as mean ± 95 % Student-t interval, and each
    allocation policy is compared with ``fix`` at the same seed and budget (paired differences).
    """
    root = Path(root)
    runs = [load_run(d) for d in find_runs(root)]
    if not runs:
        raise FileNotFoundError(f"no dofla runs (run.json) under {root}")
    groups, notes = seed_groups(runs)
    paired = paired_vs_fix(groups)
    table_rows = rows(runs, root, groups, paired)
    all_cols = list(dict.fromkeys(c for r in table_rows for c in r))
    with open(root / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=all_cols)
        writer.writeheader()
        writer.writerows(table_rows)
    keys = distinguishing_overrides(runs)
    head = [c for c in ["run", *keys, "mean_dim", *SUMMARY_METRICS] if any(c in r for r in table_rows)]
    plots = write_plots(runs, root, groups, paired)
    notes += record_differences_within_seeds(runs)
    seed_table, seed_cols = group_rows(groups, keys)
    pair_table, pair_cols = paired_rows(paired, keys)
    md = [f"# dofla report: {root}", "", markdown_table(table_rows, head), "",
          GROUP_CAPTION, "", markdown_table(seed_table, seed_cols), ""]
    if paired:
        md += [PAIRED_CAPTION, "", markdown_table(pair_table, pair_cols), ""]
    closed = gap_closed(runs)
    if closed:
        md += ["Per run, the fraction of the fix→teacher perplexity gap closed (same configuration and seed, "
               "`fix` twin):", "",
               markdown_table([{**c, "run": c["run"].get("label") or c["run"]["dir"].name} for c in closed],
                              ["run", "policy", "fix_ppl", "ppl", "teacher_ppl", "gap_closed"]), ""]
    md += [f"> note: {n}" for n in notes]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (root / "report.md").write_text("\n".join(md) + "\n")
    console = console or Console(width=max(160, Console().width))
    _print_table(table_rows, head, console, title=f"dofla report: {root}")
    _print_table(seed_table, seed_cols, console, title="across seeds: mean ± 95 % Student-t interval")
    if paired:
        _print_table(pair_table, pair_cols, console, title="paired vs fix (same seed): mean ± 95 % Student-t interval")
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    return root / "report.md"


def _print_table(table_rows, columns, console: Console, title: str) -> None:
    table = Table(title=escape(title))
    for c in columns:
        table.add_column(escape(c.removeprefix("eval/")))
    for r in table_rows:  # cells hold override values such as "[a,b]": never markup
        table.add_row(*[escape(_fmt(r.get(c))) for c in columns])
    console.print(table)


def print_run_summary(run_dir: Path, console: Console | None = None) -> str:
    """Teacher vs student perplexity, per-layer dims / DoF / attention error, time per stage."""
    console = console or Console()
    run = load_run(Path(run_dir))
    m, alloc = run["metrics"], run["allocation"]
    top = Table(title=escape(f"dofla run: {run_dir}"))
    for col in ("", "teacher", "student"):
        top.add_column(col)
    top.add_row("held-out ppl", _fmt(m.get("eval/teacher_ppl")), _fmt(m.get("eval/student_ppl")))
    top.add_row("mean feature dim", "softmax", _fmt(alloc.get("mean_dim")))
    layers = Table(title=f"per layer ({alloc.get('policy')}, budget {_fmt(alloc.get('budget'))})")
    for col in ("layer", "DoF", "dim", "attn error"):
        layers.add_column(col, justify="right")
    for i, dim in enumerate(alloc.get("dims", [])):
        dof = (alloc.get("layer_dof") or [None] * len(alloc["dims"]))[i]
        shown = str(dim) if isinstance(dim, int) else f"{layer_mean_dim(dim):.1f} ({min(dim)}–{max(dim)})"
        layers.add_row(str(i), _fmt(dof), shown, _fmt(m.get(f"eval/attn_error/layer_{i:02d}")))
    times = Table(title="wall time per stage (s)")
    for stage in run["timings"]:
        times.add_column(stage.removeprefix("time/"), justify="right")
    times.add_row(*[f"{v:.1f}" for v in run["timings"].values()])
    buffer = Console(file=io.StringIO(), width=console.width)
    for part in (top, layers, times):
        console.print(part)
        buffer.print(part)
    text = buffer.file.getvalue()
    (Path(run_dir) / "summary.txt").write_text(text)
    return text
