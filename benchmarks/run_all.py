"""Every benchmark, one command: ``python benchmarks/run_all.py [--quick] [--threads N] [--only a,b]``.

Prints one table (what | compared with | target | measured | ratio | status) and writes
benchmarks/results.md with the machine it ran on. Not tests: timings need a quiet machine.

Benchmarks are modules ``benchmarks.bench_<name>`` with ``main(argv) -> list[Row]``; one that
fails becomes a row saying so.
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, Row, as_row, machine, markdown, print_rows, save_rows, set_threads  # noqa: E402

RESULTS_MD = ROOT / "benchmarks" / "results.md"
PAGE = ROOT / "docs" / "benchmarks.md"  # its table is the last full run's (between these markers)
BEGIN, END = "<!-- begin: benchmarks/results.md -->", "<!-- end: benchmarks/results.md -->"
BENCHES = ["attention", "model", "training", "kl", "delta", "dof", "cache", "stream", "mixed_heads", "plan_student"]


def run_one(name: str, flags: list[str]) -> list[Row]:
    """Rows of ``benchmarks.bench_<name>``; a bench that fails becomes one row saying so."""
    start = time.perf_counter()
    try:
        rows = importlib.import_module(f"benchmarks.bench_{name}").main(flags) or []
    except (Exception, SystemExit) as err:  # keep going: one broken bench must not lose the others
        traceback.print_exc()
        return [Row(f"bench_{name}", "", "", f"failed: {type(err).__name__}: {err}", None, False)]
    rows = [as_row(r) for r in rows]
    save_rows(name, rows)
    print(f"[run_all] bench_{name}: {len(rows)} rows in {time.perf_counter() - start:.0f} s")
    return rows


def code_version() -> str:
    """The commit the benchmarks ran (with a note when the work tree differs from it), or why unknown."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks")
    return f"commit {commit}" + (" with uncommitted changes to src/ or benchmarks/" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 2 minutes)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores; 1 on a busy machine)")
    parser.add_argument("--only", help=f"comma list out of {','.join(BENCHES)}")
    parser.add_argument("--out", default=str(RESULTS_MD))
    args = parser.parse_args()
    threads = set_threads(args.threads)
    flags = ["--threads", str(threads)] + (["--quick"] if args.quick else [])
    names = args.only.split(",") if args.only else BENCHES
    rows: list[Row] = []
    start = time.perf_counter()
    for name in names:
        rows += run_one(name, flags)
    print_rows(rows)
    mode = "quick smoke run (small sizes; ratios not meaningful)" if args.quick else "full sizes"
    out = Path(args.out)
    body = (f"Measured on: {machine()}\n\nCode: {code_version()}\n\n"
            f"Command: `python benchmarks/run_all.py {' '.join(sys.argv[1:])}`; {mode}; "
            f"{time.perf_counter() - start:.0f} s in all.\n\n{markdown(rows)}\n")
    out.write_text(f"# dofla speed benchmarks\n\n{body}")
    print(f"wrote {out}")
    if not args.quick and not args.only and out.resolve() == RESULTS_MD.resolve():  # the page: a full run only
        PAGE.write_text(with_table(PAGE.read_text(), body))
        print(f"wrote its table into {PAGE}")


def with_table(page: str, body: str) -> str:
    """``page`` with the text between its :data:`BEGIN` and :data:`END` markers replaced by ``body``."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"run_all: {PAGE} has no {BEGIN} ... {END} block for the table; add the two markers")
    return f"{head}{BEGIN}\n{body}{END}{tail}"


if __name__ == "__main__":
    main()
