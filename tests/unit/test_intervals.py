"""Intervals over training runs and held-out text (the crossed random-effects model)."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dofla.report.intervals import crossed_interval, paired_interval
from dofla.report.stats import mean_ci


def test_the_variance_is_the_one_the_mean_squares_give_by_hand():
    x = [[1.0, 2.0, 4.0, 3.0], [2.0, 2.5, 5.0, 4.5], [0.5, 2.0, 3.0, 3.5]]
    r, s = 3, 4
    flat = [v for row in x for v in row]
    grand = sum(flat) / 12
    rows = [sum(row) / s for row in x]
    cols = [sum(x[i][j] for i in range(r)) / r for j in range(s)]
    ms_r = s * sum((m - grand) ** 2 for m in rows) / (r - 1)
    ms_s = r * sum((m - grand) ** 2 for m in cols) / (s - 1)
    ms_e = sum((x[i][j] - rows[i] - cols[j] + grand) ** 2 for i in range(r) for j in range(s)) / ((r - 1) * (s - 1))
    assert ms_r > ms_e and ms_s > ms_e  # both components are estimated, none clipped
    var = (ms_r + ms_s - ms_e) / (r * s)
    df = (ms_r + ms_s - ms_e) ** 2 / (ms_r ** 2 / (r - 1) + ms_s ** 2 / (s - 1) + ms_e ** 2 / ((r - 1) * (s - 1)))
    got = crossed_interval(x)
    assert df != math.floor(df)  # Satterthwaite's degrees of freedom are used as they are, not rounded down
    assert got.mean == pytest.approx(grand) and got.df == pytest.approx(df) and got.counts == "runs and text"
    assert got.half_width == pytest.approx(stats.t.ppf(0.975, df) * math.sqrt(var))
    assert got.half_width < stats.t.ppf(0.975, math.floor(df)) * math.sqrt(var)


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (30, 2.0423)])
def test_the_t_quantile_is_the_tabled_one(df, quantile):
    """Student's t 0.975 quantiles from the printed table, through a one-run interval of df + 1 sequences."""
    seqs = [float(i % 3) for i in range(df + 1)]
    got = crossed_interval([seqs])
    sd = torch.tensor(seqs, dtype=torch.float64).std().item()
    assert got.df == df and got.half_width == pytest.approx(quantile * sd / math.sqrt(df + 1), rel=2e-5)


def test_one_run_is_an_interval_over_the_text_and_one_sequence_over_the_runs():
    seqs = [3.1, 2.9, 3.4, 3.0, 2.7]
    one_run = crossed_interval([seqs])
    assert one_run.counts == "text only" and one_run.half_width == pytest.approx(mean_ci(seqs)[1])
    per_run = crossed_interval([[v] for v in seqs])
    assert per_run.counts == "runs only" and per_run.half_width == pytest.approx(mean_ci(seqs)[1])
    assert crossed_interval([[1.0]]).half_width is None


def test_text_variance_widens_the_interval_runs_alone_would_give():
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(1, 64, generator=gen, dtype=torch.float64)  # the same text in every run
    x = 3.0 + 0.01 * torch.randn(3, 1, generator=gen, dtype=torch.float64) + 0.5 * text
    runs_only = mean_ci(x.mean(1).tolist())[1]
    both = crossed_interval(x).half_width
    assert both > 5 * runs_only  # the runs agree; the text does not


@pytest.mark.parametrize("sd_run, sd_text", [(0.05, 0.3), (0.3, 0.05), (0.2, 0.2)])
def test_the_interval_covers_the_true_mean_about_95_percent_of_the_time(sd_run, sd_text):
    gen = torch.Generator().manual_seed(1)
    trials, covered = 400, 0
    for _ in range(trials):
        run = sd_run * torch.randn(3, 1, generator=gen, dtype=torch.float64)
        text = sd_text * torch.randn(1, 32, generator=gen, dtype=torch.float64)
        noise = 0.1 * torch.randn(3, 32, generator=gen, dtype=torch.float64)
        got = crossed_interval(2.0 + run + text + noise)
        covered += abs(got.mean - 2.0) <= got.half_width
    assert 0.90 <= covered / trials <= 0.995


def test_a_paired_comparison_is_the_interval_of_the_differences():
    a = [[1.0, 2.0, 3.0], [1.5, 2.5, 2.0]]
    b = [[0.5, 1.0, 2.0], [1.0, 1.5, 1.5]]
    got = paired_interval(a, b)
    assert got.mean == pytest.approx(crossed_interval(torch.tensor(a) - torch.tensor(b)).mean)
    with pytest.raises(ValueError, match="same runs and sequences"):
        paired_interval(a, [[1.0, 2.0]])
    with pytest.raises(ValueError, match="without NaN"):
        crossed_interval([[1.0, float("nan")]])
