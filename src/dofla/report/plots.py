"""PNG plots for a report: what a researcher would rather look at than read."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, ax, path: Path, legend: bool = True) -> Path:
    """Legend, layout, PNG, close: the end of every plot here."""
    if legend:  # outside the axes, so it never hides a curve
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(run: dict) -> str:
    return run.get("label") or " ".join(run["overrides"]) or run["dir"].name


def plot_dims(runs: list[dict], path: Path) -> Path | None:
    """Per-layer feature dims of every run (one line per run)."""
    runs = [r for r in runs if r["allocation"].get("dims")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for run in runs:
        ax.plot(run["allocation"]["dims"], marker="o", ms=3, label=_label(run))
    ax.set(xlabel="layer", ylabel="feature dimension M", title="per-layer feature dims")
    return _save(fig, ax, path)


def plot_attention_error(runs: list[dict], path: Path) -> Path | None:
    """Per-layer relative attention-output error on held-out activations, per run."""
    series = []
    for run in runs:
        errs = sorted((k, v) for k, v in run["metrics"].items() if k.startswith("eval/attn_error/layer_"))
        if errs:
            series.append((run, [v for _, v in errs]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for run, errs in series:
        ax.plot(errs, marker="o", ms=3, label=_label(run))
    ax.set(xlabel="layer", ylabel="relative error", title="attention output error vs softmax")
    return _save(fig, ax, path)


def plot_dof_heatmap(runs: list[dict], path: Path) -> Path | None:
    """Per-(layer, head) degrees of freedom from Algorithm 1 (first run that has them)."""
    table = next((r["dof"]["per_head"] for r in runs if r["dof"].get("per_head")), None)
    if table is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(table) + 1.5))
    image = ax.imshow(table, aspect="auto", cmap="viridis")
    ax.set(xlabel="head", ylabel="layer", title="degrees of freedom per (layer, head)")
    fig.colorbar(image, ax=ax)
    return _save(fig, ax, path, legend=False)


def plot_perplexity(runs: list[dict], path: Path) -> Path | None:
    """Student held-out perplexity per run, the teacher as a reference line."""
    runs = [r for r in runs if "eval/student_ppl" in r["metrics"]]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(runs)), 4))
    bars = ax.bar(range(len(runs)), [r["metrics"]["eval/student_ppl"] for r in runs])
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.axhline(runs[0]["metrics"]["eval/teacher_ppl"], color="k", ls="--", label="teacher")
    ax.set_xticks(range(len(runs)), [_label(r) for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="held-out perplexity", yscale="log", title="student vs teacher perplexity")
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


def write_plots(runs: list[dict], root: Path) -> list[Path]:
    from dofla.report.tables import distinguishing_overrides

    keys = distinguishing_overrides(runs)
    for run in runs:  # label each curve by what tells the runs apart, nothing else
        given = dict(o.partition("=")[::2] for o in run["overrides"])
        label = " ".join(f"{k.split('.')[-1]}={given[k]}" for k in keys if k in given and "dir" not in k)
        run["label"] = label[:60] or run["dir"].name
    made = [
        plot_dof_heatmap(runs, root / "dof_heatmap.png"),
        plot_dims(runs, root / "dims.png"),
        plot_attention_error(runs, root / "attn_error.png"),
        plot_perplexity(runs, root / "perplexity.png"),
        plot_training(runs, root / "training.png"),
    ]
    return [p for p in made if p is not None]
