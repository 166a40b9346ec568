"""The mean of one number per training run, with its two-sided Student-t interval over the runs.

``python -m studies.over_runs V1 V2 [V3 ...] [--level 0.95]``

The results pages quote "mean ± 95 % t over runs" for rows whose runs were scored separately (say,
each run's paired difference from ``studies.paired_heldout``, or a run whose directory is gone and
whose number is on its page). This prints that line from the per-run numbers, so it can be
recomputed rather than trusted: the interval is t(1 − α/2, n − 1) · s / √n with the runs as the unit.
"""
from __future__ import annotations

import argparse

from dofla.report import mean_ci


def over_runs(values: list[float], level: float = 0.95) -> str:
    """One line: the mean ± the interval's half-width, the level, n and the degrees of freedom."""
    mean, half = mean_ci(values, level)
    n = len(values)
    if half is None:
        return f"{mean:.4g} (one value, no interval: give one number per run)"
    return f"{mean:.4g} ± {half:.2g} (mean ± {level * 100:g} % t over {n} runs, {n - 1} degrees of freedom)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.over_runs", description=__doc__.split("\n")[0])
    parser.add_argument("values", nargs="+", type=float, help="one number per training run")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level, in (0, 1) (default 0.95)")
    args = parser.parse_args(argv)
    if not 0.0 < args.level < 1.0:
        parser.error(f"--level must be in (0, 1), got {args.level}: use 0.95 for a 95 % interval")
    print(over_runs(args.values, args.level))


if __name__ == "__main__":
    main()
