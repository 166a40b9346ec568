"""Student held-out perplexity against distillation tokens, from finished runs.

``python benchmarks/quality_vs_tokens.py RUN_OR_SWEEP_DIR... --out docs/quality_vs_tokens.png``
reads every ``metrics.json`` below the given directories, groups the runs by feature map and
allocation policy (from ``run.json``), and plots ``eval/student_ppl`` against ``train/tokens`` (log
x), with the teacher's perplexity as a line. It also prints the table it plotted.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def collect(roots: list[Path]) -> list[dict]:
    """One row per finished run: its label, tokens, perplexities and mean attention error."""
    rows = []
    for root in roots:
        for metrics_path in sorted(root.rglob("metrics.json")):
            run = metrics_path.parent
            metrics = json.loads(metrics_path.read_text())
            config = json.loads((run / "run.json").read_text())["config"]
            if "train/tokens" not in metrics or not metrics["train/tokens"]:
                continue
            label = f"{config['feature_map']['name']}, {config['allocation']['policy']}"
            rows.append({"run": str(run), "label": label, "tokens": metrics["train/tokens"],
                         "source": config["train"].get("source", "cache"),
                         "student_ppl": metrics["eval/student_ppl"], "teacher_ppl": metrics["eval/teacher_ppl"],
                         "attn_error": metrics.get("eval/attn_error/mean")})
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    for row in rows:
        series[row["label"]].append(row)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(series.items()):
        points.sort(key=lambda r: r["tokens"])
        ax.plot([p["tokens"] for p in points], [p["student_ppl"] for p in points], marker="o", label=label)
    ax.axhline(rows[0]["teacher_ppl"], color="black", linestyle="--", label="teacher")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distillation tokens (train/tokens)")
    ax.set_ylabel("student held-out perplexity")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("quality_vs_tokens.png"))
    args = parser.parse_args()
    rows = collect(args.dirs)
    if not rows:
        raise SystemExit("no finished runs with train/tokens under " + ", ".join(map(str, args.dirs)))
    print("| feature map, allocation | source | tokens | student ppl | mean attention error | run |")
    print("|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["label"], r["tokens"])):
        print(f"| {row['label']} | {row['source']} | {row['tokens']:,} | {row['student_ppl']:.2f} | "
              f"{row['attn_error']:.3f} | {row['run']} |")
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
