"""The mean of one number per training run, with its two-sided Student-t interval over the runs.

``python -m studies.over_runs V1 V2 [V3 ...] [--minus W1 W2 [W3 ...]] [--level 0.95]``

The results pages quote "mean ± 95 % t over runs" for rows whose runs were scored separately (say,
each run's paired difference from ``studies.paired_heldout``, or a run whose directory is gone and
whose number is on its page). This prints that line from the per-run numbers, so it can be
recomputed rather than trusted: the interval is t(1 − α/2, n − 1) · s / √n with the runs as the unit.

``--minus`` compares two arms whose runs are not matched one to one (say, three layerwise-only
students against three KL students trained on other text): the difference of the two means with
Welch's interval (each arm its own variance, the Welch–Satterthwaite degrees of freedom as they
are, fractional). Runs that are matched (the same data order, the same text) are compared more tightly by
giving their per-run differences without ``--minus``.
"""
from __future__ import annotations

import argparse

from dofla.report import mean_ci, welch_ci


def over_runs(values: list[float], level: float = 0.95) -> str:
    """One line: the mean ± the interval's half-width, the level, n and the degrees of freedom."""
    mean, half = mean_ci(values, level)
    n = len(values)
    if half is None:
        return f"{mean:.4g} (one value, no interval: give one number per run)"
    return f"{mean:.4g} ± {half:.2g} (mean ± {level * 100:g} % t over {n} runs, {n - 1} degrees of freedom)"


def minus(values: list[float], others: list[float], level: float = 0.95) -> str:
    """One line: mean(values) − mean(others) ± Welch's half-width, the level, the groups and the degrees of freedom."""
    diff, half, df = welch_ci(values, others, level)
    return (f"{diff:.4g} ± {half:.2g} (difference of means ± {level * 100:g} % Welch t, {len(values)} runs minus "
            f"{len(others)} runs, {df:.3g} degrees of freedom)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.over_runs", description=__doc__.split("\n")[0])
    parser.add_argument("values", nargs="+", type=float, help="one number per training run")
    parser.add_argument("--minus", type=float, nargs="+", default=None, metavar="W",
                        help="one number per run of a second, unmatched arm: print the difference of the means, Welch's interval")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level, in (0, 1) (default 0.95)")
    args = parser.parse_args(argv)
    if not 0.0 < args.level < 1.0:
        parser.error(f"--level must be in (0, 1), got {args.level}: use 0.95 for a 95 % interval")
    if args.minus is not None and (len(args.values) < 2 or len(args.minus) < 2):
        parser.error("--minus needs at least two runs in each arm: one run has no spread to put an interval on")
    print(over_runs(args.values, args.level) if args.minus is None else minus(args.values, args.minus, args.level))


if __name__ == "__main__":
    main()
