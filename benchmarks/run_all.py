"""Every benchmark, one command: ``python benchmarks/run_all.py [--quick]``.

Prints one table (what | compared with | target | measured | ratio | status) and writes
benchmarks/results.md with the machine it ran on. Not tests: CI machines are too noisy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_attention, bench_model, bench_pipeline  # noqa: E402
from benchmarks.common import Row, machine, print_rows  # noqa: E402


def markdown(rows: list[Row]) -> str:
    lines = ["| what | compared with | target | measured | ratio | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        status = "n/a" if r.ok is None else ("ok" if r.ok else "**MISS**")
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.what} | {r.compared_with} | {r.target} | {r.measured} | {ratio} | {status}{note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run in a few minutes")
    args = parser.parse_args()
    seq = 2048 if args.quick else 16384
    rows = bench_attention.main(seq, repeats=1 if args.quick else 3)
    rows += bench_model.main(1024 if args.quick else seq, 4 if args.quick else 16, args.quick)
    rows += bench_pipeline.main(args.quick)
    print_rows(rows)
    out = Path(__file__).resolve().parent / "results.md"
    out.write_text(f"Measured on: {machine()}\n\n{markdown(rows)}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
