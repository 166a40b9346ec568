"""Keep the run records a results page is built from: ``python -m studies.records RUN_DIR... --into DIR``.

Each finished run's ``run.json``, ``metrics.json``, per-sequence values and KL curve (no weights, tens of
KB) are written to ``DIR/<run name>/`` (``dofla.report.collect_record``); a results page's tables are then
recomputed from them by ``python -m studies.results PAGE``. A directory given that holds runs below it
(a sweep) contributes every finished run in it. ``--allocation-only``: runs that stopped after the
allocate stage (``stages=[cache,allocate]``), kept as their run.json and allocation.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dofla.report import collect_allocation_record, collect_record


def finished_runs(paths: list[Path]) -> list[Path]:
    """Each path that is a finished run (metrics.json beside run.json), or the finished runs below it."""
    runs = []
    for path in paths:
        if (path / "metrics.json").is_file() and (path / "run.json").is_file():
            runs.append(path)
        else:
            runs += sorted(p.parent for p in path.glob("*/metrics.json") if (p.parent / "run.json").is_file())
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.records", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or sweeps holding them")
    parser.add_argument("--into", type=Path, required=True, help="e.g. docs/results/runs/headline")
    parser.add_argument("--allocation-only", action="store_true",
                        help="the runs stopped after the allocate stage: keep run.json and allocation.json")
    args = parser.parse_args(argv)
    if args.allocation_only:
        for run in args.runs:
            print(f"records: {collect_allocation_record(run, args.into)}")
        return
    runs = finished_runs(args.runs)
    if not runs:
        raise SystemExit(f"no finished run (run.json and metrics.json) in {', '.join(map(str, args.runs))}")
    for run in runs:
        print(f"records: {collect_record(run, args.into)}")


if __name__ == "__main__":
    main()
