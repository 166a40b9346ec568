"""``dofla-report --table tokens``: student held-out perplexity and per-layer attention error
against distillation tokens, over seeds.

``dofla-report --table tokens RUN_OR_SWEEP_DIR... --out docs/quality_vs_tokens.png``
reads every finished run below the given directories (:func:`dofla.report.tables.load_run`; runs
whose ``metrics.json`` has ``train/tokens`` > 0), labels it by feature map and allocation policy (plus the attention,
the loss and "streamed" where they differ from a cached linear student with the softmax loss),
and groups the runs by (label, tokens): the runs of one point are its seeds. It prints a table
(mean over seeds with the half-width of the 95 % Student-t interval) and plots student perplexity
against tokens (log-log, teacher dashed). A second figure (``--layers-out``, default ``--out`` with
``_layers`` before the suffix) shows the seed-mean held-out attention error per layer, one panel per
label, one line per token count; a second table lists the same values, rows = layers, columns =
"label @ tokens".
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from dofla.report.stats import mean_ci
from dofla.report.tables import find_runs, load_run

LAYER_PREFIX = "eval/attn_error/layer_"


def run_label(config: dict) -> str:
    """"feature map, policy", with the attention, loss and "streamed" appended where they differ
    from the cached linear student with the softmax loss, so unlike runs never share a line."""
    parts = [config["feature_map"]["name"], config["allocation"]["policy"]]
    attention = config.get("attention") or {}
    if attention.get("name", "linear") != "linear":
        parts.append(f"{attention['name']} w{attention.get('window')} s{attention.get('sinks')}")
    loss = (config.get("loss") or {}).get("name", "softmax")
    if loss != "softmax":
        parts.append(f"{loss} loss")
    # streamed and cached distillation differ in more than tokens; one line must not join them
    if config.get("train", {}).get("source") == "stream":
        parts.append("streamed")
    return ", ".join(parts)


def collect(roots: list[Path]) -> list[dict]:
    """One row per finished run: label, tokens, seed, perplexities, mean and per-layer attention
    error (``layers``: list indexed by layer). Runs without ``train/tokens`` > 0 are skipped."""
    rows = []
    for root in roots:
        for run in find_runs(root):
            loaded = load_run(run)
            metrics, config = loaded["metrics"], loaded["record"].get("config")
            if not metrics.get("train/tokens") or not config:
                continue
            layer_keys = sorted((k for k in metrics if k.startswith(LAYER_PREFIX)),
                                key=lambda k: int(k[len(LAYER_PREFIX):]))
            rows.append({"run": str(run), "label": run_label(config), "tokens": int(metrics["train/tokens"]),
                         "seed": config.get("seed"), "source": config.get("train", {}).get("source", "cache"),
                         "student_ppl": metrics["eval/student_ppl"], "teacher_ppl": metrics["eval/teacher_ppl"],
                         "attn_error": metrics.get("eval/attn_error/mean"),
                         "layers": [metrics[k] for k in layer_keys]})
    return rows


def group(rows: list[dict], level: float = 0.95) -> list[dict]:
    """One point per (label, tokens), sorted: ``n`` seeds, ``ppl``/``ppl_half`` (mean and Student-t
    half-width, None for one seed), ``attn``/``attn_half`` likewise, ``layers`` (seed mean per layer)."""
    by_key = defaultdict(list)
    for row in rows:
        by_key[(row["label"], row["tokens"])].append(row)
    points = []
    for (label, tokens), runs in sorted(by_key.items()):
        depths = {len(r["layers"]) for r in runs}
        if len(depths) > 1:
            raise ValueError(f"runs of '{label}' at {tokens} tokens report different layer counts {sorted(depths)}; "
                             "pass only directories of runs of the same model")
        seeds = [r["seed"] for r in runs]
        if len(set(seeds)) < len(seeds):
            print(f"warning: '{label}' at {tokens} tokens has repeated seeds {seeds}: runs that differ "
                  "in something other than the label are averaged together", file=sys.stderr)
        ppl, ppl_half = mean_ci([r["student_ppl"] for r in runs], level)
        errors = [r["attn_error"] for r in runs if r["attn_error"] is not None]
        attn, attn_half = mean_ci(errors, level) if errors else (None, None)
        layers = [sum(vals) / len(vals) for vals in zip(*(r["layers"] for r in runs))]
        points.append({"label": label, "tokens": tokens, "n": len(runs), "seeds": seeds,
                       "ppl": ppl, "ppl_half": ppl_half, "attn": attn, "attn_half": attn_half,
                       "teacher_ppl": sum(r["teacher_ppl"] for r in runs) / len(runs), "layers": layers})
    return points


def short_tokens(tokens: int) -> str:
    """65536 -> '64k', 1048576 -> '1M' (binary units, as the token budgets are chosen)."""
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if tokens >= size and tokens % (size // 8) == 0:
            return f"{tokens / size:g}{unit}"
    return f"{tokens:,}"


def _with_half(mean: float | None, half: float | None, digits: int) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" if half is None else f"{mean:.{digits}f} ± {half:.{digits}f}"


def summary_table(points: list[dict]) -> str:
    """Markdown: one row per point, mean ± 95 % half-width over its seeds."""
    lines = ["| feature map, allocation | tokens | n | seeds | student ppl (95 % CI) | "
             "mean attention error (95 % CI) | teacher ppl |", "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['label']} | {p['tokens']:,} | {p['n']} | {', '.join(map(str, p['seeds']))} | "
                     f"{_with_half(p['ppl'], p['ppl_half'], 2)} | {_with_half(p['attn'], p['attn_half'], 3)} | "
                     f"{p['teacher_ppl']:.2f} |")
    return "\n".join(lines)


def layer_table(points: list[dict]) -> str:
    """Markdown: rows = layers, columns = "label @ tokens", cells = seed-mean attention error."""
    depth = max(len(p["layers"]) for p in points)
    header = [f"{p['label']} @ {short_tokens(p['tokens'])}" for p in points]
    lines = ["| layer | " + " | ".join(header) + " |", "|---" * (len(points) + 1) + "|"]
    for layer in range(depth):
        cells = [f"{p['layers'][layer]:.3f}" if layer < len(p["layers"]) else "" for p in points]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layers_path(out: Path) -> Path:
    """Default per-layer figure path: ``--out`` with ``_layers`` before its suffix."""
    return out.with_name(f"{out.stem}_layers{out.suffix or '.png'}")


def _pyplot():
    import matplotlib  # lazy: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: only when a plot is drawn

    return plt


def _log_axes(ax, budgets: list[int]) -> None:
    """Log-log with the token budgets as the x ticks and plain numbers on y."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # lazy: only when a plot is drawn

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(budgets, [short_tokens(t) for t in budgets])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_ppl(points: list[dict], out: Path) -> None:
    """Student perplexity (seed mean, 95 % t bars where n > 1) against tokens, log-log."""
    plt = _pyplot()
    series = defaultdict(list)
    for p in points:
        series[p["label"]].append(p)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda p: p["tokens"])
        # a log axis cannot show a bar reaching zero: the lower arm stops just above it
        lower = [min(p["ppl_half"] or 0.0, 0.999 * p["ppl"]) for p in pts]
        upper = [p["ppl_half"] or 0.0 for p in pts]
        ax.errorbar([p["tokens"] for p in pts], [p["ppl"] for p in pts], yerr=[lower, upper],
                    marker="o", capsize=4, label=label)
        for p in pts:
            ax.annotate(f"n={p['n']}", (p["tokens"], p["ppl"]), textcoords="offset points",
                        xytext=(5, 4), fontsize=7)
    teacher = sum(p["teacher_ppl"] for p in points) / len(points)
    ax.axhline(teacher, color="black", linestyle="--", label=f"teacher ({teacher:.2f})")
    _log_axes(ax, sorted({p["tokens"] for p in points}))
    ax.set_xlabel("distillation tokens (train/tokens)")
    ax.set_ylabel("student held-out perplexity")
    ax.set_title("mean over seeds, 95 % Student-t interval where n > 1")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_layers(points: list[dict], out: Path) -> None:
    """Per-layer held-out attention error, one panel per label, one line per token count
    (colour ramp from few to many tokens over all points)."""
    plt = _pyplot()
    labels = sorted({p["label"] for p in points})
    budgets = sorted({p["tokens"] for p in points})
    cmap = plt.get_cmap("viridis")
    colour = {t: cmap(i / max(len(budgets) - 1, 1) * 0.9) for i, t in enumerate(budgets)}
    cols = min(3, len(labels))
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(labels):]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, labels):
        for p in sorted((p for p in points if p["label"] == label), key=lambda p: p["tokens"]):
            ax.plot(range(len(p["layers"])), p["layers"], marker=".", color=colour[p["tokens"]],
                    label=f"{short_tokens(p['tokens'])} tokens (n={p['n']})")
        ax.set_title(label)
        ax.set_xlabel("layer index")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("held-out attention error\n(seed mean)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dofla-report --table tokens", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("quality_vs_tokens.png"))
    parser.add_argument("--layers-out", type=Path, default=None,
                        help="per-layer figure (default: --out with _layers before the suffix)")
    args = parser.parse_args(argv)
    rows = collect(args.dirs)
    if not rows:
        raise SystemExit("no finished runs with train/tokens > 0 under " + ", ".join(map(str, args.dirs))
                         + "; point at run or sweep directories whose metrics.json has train/tokens")
    points = group(rows)
    print(summary_table(points))
    print()
    print(layer_table(points))
    layers_out = args.layers_out or layers_path(args.out)
    plot_ppl(points, args.out)
    plot_layers(points, layers_out)
    print(f"wrote {args.out} and {layers_out}")

