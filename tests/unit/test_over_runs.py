"""studies.over_runs: the per-run mean ± t interval the results pages quote, recomputable."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from dofla.report import welch_ci
from studies.over_runs import minus, over_runs

ROOT = Path(__file__).resolve().parents[2]


def test_the_line_is_the_student_t_interval_over_runs():
    values = [1.0, 2.0, 4.0]
    sd = math.sqrt(sum((v - 7 / 3) ** 2 for v in values) / 2)
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, 2 degrees of freedom), from tables
    assert over_runs(values) == f"2.333 ± {half:.2g} (mean ± 95 % t over 3 runs, 2 degrees of freedom)"
    assert over_runs(values, 0.99).startswith("2.333 ± 8.8 ")  # t(0.995, 2) = 9.925: a wider interval
    assert over_runs([5.0]) == "5 (one value, no interval: give one number per run)"


def test_the_command_reads_negative_differences_and_refuses_a_percent_level():
    run = lambda *a: subprocess.run([sys.executable, "-m", "studies.over_runs", *a], cwd=ROOT,
                                    capture_output=True, text=True)
    done = run("-0.058", "-0.0672", "-0.0695")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("-0.0649 ± 0.015 (mean ± 95 % t over 3 runs")
    refused = run("1", "2", "--level", "95")
    assert refused.returncode == 2 and "use 0.95 for a 95 % interval" in refused.stderr


def test_minus_is_the_welch_interval_of_two_unmatched_arms():
    # a = 1, 2, 3 (variance 1), b = 4, 6, 8 (variance 4): se² = 1/3 + 4/3 = 5/3, Welch–Satterthwaite
    # df = (5/3)² / ((1/3)²/2 + (4/3)²/2) = 2.941 (kept fractional); t(0.975, 2.941) = 3.218759, between
    # the tables' t(0.975, 3) = 3.182446 and t(0.975, 2) = 4.302653.
    diff, half, df = welch_ci([1.0, 2.0, 3.0], [4.0, 6.0, 8.0])
    assert diff == -4.0 and df == pytest.approx(50 / 17)
    assert half == pytest.approx(3.218759 * math.sqrt(5 / 3), rel=1e-5)
    # equal variances and sizes: df = 2(n − 1), the pooled two-sample t interval
    diff, half, df = welch_ci([0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0])
    assert diff == -10.0 and df == pytest.approx(6)
    assert half == pytest.approx(2.446912 * math.sqrt(2 * (5 / 3) / 4), rel=1e-5)  # t(0.975, 6)
    assert minus([1.0, 2.0, 3.0], [4.0, 6.0, 8.0]).startswith(
        f"-4 ± {3.218759 * math.sqrt(5 / 3):.2g} (difference of means ± 95 % Welch t, 3 runs minus 3 runs, 2.94 degrees")
    with pytest.raises(ValueError, match="at least two values per group"):
        welch_ci([1.0], [2.0, 3.0])


def test_the_command_takes_a_second_arm_and_refuses_one_run_in_it():
    run = lambda *a: subprocess.run([sys.executable, "-m", "studies.over_runs", *a], cwd=ROOT,
                                    capture_output=True, text=True)
    done = run("1", "2", "3", "--minus", "4", "6", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("-4 ± 4.2 (difference of means ± 95 % Welch t")
    refused = run("1", "2", "3", "--minus", "4")
    assert refused.returncode == 2 and "at least two runs in each arm" in refused.stderr
