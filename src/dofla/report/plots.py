"""PNG plots for a report: what a researcher would rather look at than read."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(run: dict) -> str:
    return " ".join(run["overrides"]) or run["dir"].name


def plot_dims(runs: list[dict], path: Path) -> Path | None:
    """Per-layer feature dims of every run (one line per run)."""
    runs = [r for r in runs if r["allocation"].get("dims")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in runs:
        ax.plot(run["allocation"]["dims"], marker="o", ms=3, label=_label(run))
    ax.set(xlabel="layer", ylabel="feature dimension M", title="per-layer feature dims")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attention_error(runs: list[dict], path: Path) -> Path | None:
    """Per-layer relative attention-output error on held-out activations, per run."""
    series = []
    for run in runs:
        errs = sorted((k, v) for k, v in run["metrics"].items() if k.startswith("eval/attn_error/layer_"))
        if errs:
            series.append((run, [v for _, v in errs]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for run, errs in series:
        ax.plot(errs, marker="o", ms=3, label=_label(run))
    ax.set(xlabel="layer", ylabel="relative error", title="attention output error vs softmax")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_dof_heatmap(runs: list[dict], path: Path) -> Path | None:
    """Per-(layer, head) degrees of freedom from Algorithm 1 (first run that has them)."""
    table = next((r["dof"]["per_head"] for r in runs if r["dof"].get("per_head")), None)
    if table is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(table) + 1.5))
    image = ax.imshow(table, aspect="auto", cmap="viridis")
    ax.set(xlabel="head", ylabel="layer", title="degrees of freedom per (layer, head)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_perplexity(runs: list[dict], path: Path) -> Path | None:
    """Student held-out perplexity per run, the teacher as a reference line."""
    runs = [r for r in runs if "eval/student_ppl" in r["metrics"]]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(runs)), 4))
    ax.bar(range(len(runs)), [r["metrics"]["eval/student_ppl"] for r in runs])
    ax.axhline(runs[0]["metrics"]["eval/teacher_ppl"], color="k", ls="--", label="teacher")
    ax.set_xticks(range(len(runs)), [_label(r) for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="held-out perplexity", yscale="log", title="student vs teacher perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: list[dict], root: Path) -> list[Path]:
    made = [
        plot_dof_heatmap(runs, root / "dof_heatmap.png"),
        plot_dims(runs, root / "dims.png"),
        plot_attention_error(runs, root / "attn_error.png"),
        plot_perplexity(runs, root / "perplexity.png"),
    ]
    return [p for p in made if p is not None]
