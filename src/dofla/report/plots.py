"""PNG plots for a report: what a researcher would rather look at than read."""
from __future__ import annotations

from pathlib import Path

from dofla.feature_maps.blocks import layer_mean_dim
from dofla.report.dof_plots import plot_dof_heatmap, plot_dof_profile, plot_dof_vs_sensitivity
from dofla.report.plot_common import _save, _yerr, plt
from dofla.report.seeds import distinguishing_overrides, paired_vs_fix, seed_groups


def _label(run: dict) -> str:
    return run.get("label") or " ".join(run["overrides"]) or run["dir"].name


def plot_dims(runs: list[dict], path: Path) -> Path | None:
    """Per-layer feature dims of every run (one line per run)."""
    runs = [r for r in runs if r["allocation"].get("dims")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for run in runs:  # per-head dims (dof_head): the layer's mean, its heads' range shaded
        dims = run["allocation"]["dims"]
        line, = ax.plot([layer_mean_dim(d) for d in dims], marker="o", ms=3, label=_label(run))
        if any(not isinstance(d, int) for d in dims):
            lo = [d if isinstance(d, int) else min(d) for d in dims]
            hi = [d if isinstance(d, int) else max(d) for d in dims]
            ax.fill_between(range(len(dims)), lo, hi, color=line.get_color(), alpha=0.15)
    ax.set(xlabel="layer", ylabel="feature dimension M (mean over heads)", title="per-layer feature dims")
    return _save(fig, ax, path)


def plot_attention_error(groups: list[dict], path: Path) -> Path | None:
    """Per-layer relative attention-output error on held-out activations: per seed group, the mean
    over seeds with the 95 % t interval as error bars."""
    series = []
    for group in groups:
        errs = sorted((k, v) for k, v in group["stats"].items() if k.startswith("eval/attn_error/layer_"))
        if errs:
            series.append((group, errs))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for group, errs in series:
        ax.errorbar(range(len(errs)), [v[0] for _, v in errs], yerr=_yerr([v[1] for _, v in errs]),
                    marker="o", ms=3, capsize=2, label=group["label"])
    ax.set(xlabel="layer", ylabel="relative error", title="attention output error vs softmax (mean ± 95 % t CI)")
    return _save(fig, ax, path)


def plot_perplexity(groups: list[dict], path: Path) -> Path | None:
    """Student held-out perplexity per seed group (mean ± 95 % t CI), the teacher as a reference line."""
    groups = [g for g in groups if "eval/student_ppl" in g["stats"]]
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 * len(groups)), 4))
    stats = [g["stats"]["eval/student_ppl"] for g in groups]
    bars = ax.bar(range(len(groups)), [m for m, _, _ in stats], yerr=_yerr([h for _, h, _ in stats]), capsize=3)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    teacher = groups[0]["stats"].get("eval/teacher_ppl")
    if teacher:
        ax.axhline(teacher[0], color="k", ls="--", label="teacher")
    ax.set_xticks(range(len(groups)), [g["label"] for g in groups], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="held-out perplexity", yscale="log", title="student vs teacher perplexity (mean ± 95 % t CI)")
    return _save(fig, ax, path)


def plot_training(runs: list[dict], path: Path) -> Path | None:
    """Per-layer held-out distillation loss before and after layerwise training, per run."""
    runs = [r for r in runs if r.get("train")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for n, run in enumerate(runs):
        layers = sorted(run["train"])
        color = f"C{n % 10}"
        ax.plot([run["train"][k]["initial_heldout_loss"] for k in layers], ls=":", color=color)
        ax.plot([run["train"][k]["final_heldout_loss"] for k in layers], marker="o", ms=3, color=color,
                label=_label(run))
    ax.set(xlabel="layer", ylabel="held-out loss", title="layerwise training: before (dotted) and after")
    return _save(fig, ax, path)


def plot_tasks(groups: list[dict], path: Path) -> Path | None:
    """Zero-shot accuracy per task: one bar per seed group (mean ± 95 % t CI), the teacher as a
    black tick per task."""
    per_group = []
    for group in groups:
        acc = {k.split("/")[2]: v for k, v in group["stats"].items()
               if k.startswith("tasks/student/") and k.endswith("/acc")}
        if acc:
            per_group.append((group, acc))
    if not per_group:
        return None
    tasks = sorted({t for _, acc in per_group for t in acc})
    width = 0.8 / len(per_group)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(tasks) * max(1, len(per_group) / 3)), 4))
    for n, (group, acc) in enumerate(per_group):
        xs = [i - 0.4 + width * (n + 0.5) for i in range(len(tasks))]
        ax.bar(xs, [acc[t][0] if t in acc else float("nan") for t in tasks], width, capsize=2,
               yerr=_yerr([acc[t][1] if t in acc else None for t in tasks]), label=group["label"])
    for i, task in enumerate(tasks):
        teacher = [g["stats"][f"tasks/teacher/{task}/acc"][0] for g, _ in per_group
                   if f"tasks/teacher/{task}/acc" in g["stats"]]
        if teacher:
            ax.hlines(sum(teacher) / len(teacher), i - 0.45, i + 0.45, colors="k", linestyles="--",
                      label="teacher" if i == 0 else None)
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="accuracy (zero-shot)", ylim=(0, 1),
           title="downstream tasks: students vs teacher (mean ± 95 % t CI)")
    return _save(fig, ax, path)


def plot_mqar(groups: list[dict], path: Path) -> Path | None:
    """Associative-recall accuracy vs sequence length per seed group (mean ± 95 % t CI), the
    teacher dashed."""
    def curve(group, who):
        pts = sorted((int(k.rsplit("/T", 1)[1]), v) for k, v in group["stats"].items()
                     if k.startswith(f"mqar/{who}/T"))
        return [p[0] for p in pts], [p[1][0] for p in pts], _yerr([p[1][1] for p in pts])

    groups = [g for g in groups if any(k.startswith("mqar/student/") for k in g["stats"])]
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*curve(groups[0], "teacher")[:2], "k--", marker="s", ms=4, label="teacher")
    for group in groups:
        xs, ys, err = curve(group, "student")
        ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, capsize=2, label=group["label"])
    lengths = sorted({t for group in groups for t in curve(group, "student")[0]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.minorticks_off()
    ax.set(xlabel="sequence length", ylabel="recall accuracy", ylim=(0, 1.02),
           title="multi-query associative recall (MQAR, mean ± 95 % t CI)")
    return _save(fig, ax, path)


def plot_gap_closed(paired: list[dict], path: Path) -> Path | None:
    """Share of the fix→teacher held-out-loss gap each policy closes at the same seed and budget
    (mean over seeds ± 95 % t CI)."""
    closed = [p for p in paired if "gap_closed" in p["stats"]]
    if not closed:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(closed)), 4.5))
    stats = [p["stats"]["gap_closed"] for p in closed]
    bars = ax.bar(range(len(closed)), [m for m, _, _ in stats], yerr=_yerr([h for _, h, _ in stats]), capsize=3,
                  color=["C1" if m >= 0 else "C3" for m, _, _ in stats])
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(closed)), [p["group"]["label"] for p in closed], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="(loss_fix − loss) / (loss_fix − loss_teacher)",
           title="fix→teacher loss gap closed (mean ± 95 % t CI)")
    return _save(fig, ax, path, legend=False)


def write_plots(runs: list[dict], root: Path, groups: list[dict] | None = None,
                paired: list[dict] | None = None) -> list[Path]:
    """Every plot that the runs have data for; ``groups`` / ``paired`` (from ``dofla.report.seeds``)
    are computed here when not given."""
    if groups is None:
        groups = seed_groups(runs)[0]
    if paired is None:
        paired = paired_vs_fix(groups)
    keys = distinguishing_overrides(runs)
    for run in runs:  # label each curve by what tells the runs apart, nothing else
        run["label"] = _short_label(run, keys) or run["dir"].name
    for group in groups:
        label = _short_label(group["runs"][0], [k for k in keys if k != "seed"]) or "all runs"
        group["label"] = f"{label} (n={len(group['runs'])})"
    made = [
        plot_dof_heatmap(runs, root / "dof_heatmap.png"),
        plot_dof_profile(runs, root / "dof_profile.png"),
        plot_dof_vs_sensitivity(groups, root / "dof_vs_sensitivity.png"),
        plot_dims(runs, root / "dims.png"),
        plot_attention_error(groups, root / "attn_error.png"),
        plot_perplexity(groups, root / "perplexity.png"),
        plot_training(runs, root / "training.png"),
        plot_tasks(groups, root / "tasks.png"),
        plot_mqar(groups, root / "mqar.png"),
        plot_gap_closed(paired, root / "gap_closed.png"),
    ]
    return [p for p in made if p is not None]


def _short_label(run: dict, keys: list[str]) -> str:
    given = dict(o.partition("=")[::2] for o in run["overrides"])
    return " ".join(f"{k.split('.')[-1]}={given[k]}" for k in keys if k in given and "dir" not in k)[:60]
