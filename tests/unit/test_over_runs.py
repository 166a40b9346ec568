"""studies.over_runs: the per-run mean ± t interval the results pages quote, recomputable."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from studies.over_runs import over_runs

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
