"""Intervals that count what varies: the training runs and the held-out text.

Every run of a comparison is scored on the same held-out sequences (or the same passkey prompts), so
a mean over runs carries two kinds of chance: which training run (data order, seed), and which text.
An interval over runs alone treats the text as fixed; one over sequences alone treats the run as
fixed. With ``x[r, s]`` the value of run r on sequence s, the crossed random-effects model

    x[r, s] = μ + a_r + b_s + e[r, s],   a ~ (0, σ²_run),  b ~ (0, σ²_text),  e ~ (0, σ²_e)

gives the grand mean the variance σ²_run/R + σ²_text/S + σ²_e/(RS). The components are estimated from
the two-way ANOVA mean squares (a negative estimate is set to 0), and the interval is Student's t with
Satterthwaite's degrees of freedom, fractional as the approximation gives them (``scipy.stats.t``). A
paired comparison, two students trained on the same data orders and scored on the same text, is the same
computation on the differences. With one
run the interval is over the text alone, and with one sequence (a number per run) over runs alone;
:class:`Interval` says which.

Shares (passkey prompts recalled, MQAR queries) are counts, not means of a roughly normal quantity, and do
not belong here: the results pages give them binomial intervals (``dofla.report.shares``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats


@dataclass(frozen=True)
class Interval:
    """A mean, the half-width of its two-sided interval, and what the interval counts."""

    mean: float
    half_width: float | None  # None: nothing varies that could be counted (one run, one sequence)
    df: float | None  # Satterthwaite's degrees of freedom, not rounded
    runs: int
    sequences: int
    counts: str  # "runs and text" | "text only" | "runs only" | "nothing"

    def __str__(self) -> str:
        if self.half_width is None:
            return f"{self.mean:.3f}"
        return f"{self.mean:.3f} ± {self.half_width:.3f}"


def _t(level: float, df: float) -> float:
    """The two-sided ``level`` quantile of Student's t with ``df`` (possibly fractional) degrees of freedom."""
    return float(stats.t.ppf(0.5 + level / 2, df))


def _mean_squares(x: torch.Tensor) -> tuple[float, float, float]:
    """(MS_runs, MS_text, MS_error) of a balanced two-way layout ``x`` (R, S), float64."""
    runs, seqs = x.shape
    grand, row, col = x.mean(), x.mean(1, keepdim=True), x.mean(0, keepdim=True)
    ms_run = seqs * ((row - grand) ** 2).sum().item() / (runs - 1)
    ms_text = runs * ((col - grand) ** 2).sum().item() / (seqs - 1)
    ms_error = ((x - row - col + grand) ** 2).sum().item() / ((runs - 1) * (seqs - 1))
    return ms_run, ms_text, ms_error


def crossed_interval(values, level: float = 0.95) -> Interval:
    """The mean of ``values`` (R runs × S sequences; a list of lists or a tensor, no NaN) and its
    interval over runs and text together (the module docstring's model)."""
    x = torch.as_tensor(values, dtype=torch.float64)
    if x.dim() != 2 or x.numel() == 0 or torch.isnan(x).any():
        raise ValueError(f"values must be a non-empty (runs, sequences) table without NaN, got shape {tuple(x.shape)}")
    runs, seqs = x.shape
    mean = x.mean().item()
    if runs == 1 or seqs == 1:  # one axis: a plain t interval over the other
        line, counts = (x[0], "text only") if runs == 1 else (x[:, 0], "runs only")
        if line.numel() == 1:
            return Interval(mean, None, None, runs, seqs, "nothing")
        n = line.numel()
        half = _t(level, n - 1) * math.sqrt(line.var().item() / n)
        return Interval(mean, half, n - 1, runs, seqs, counts)
    ms_run, ms_text, ms_error = _mean_squares(x)
    with_run, with_text = ms_run > ms_error, ms_text > ms_error
    # V·RS = 1{run}(MS_run − MS_e) + 1{text}(MS_text − MS_e) + MS_e: each component at least 0
    terms = [(float(with_run), ms_run, runs - 1), (float(with_text), ms_text, seqs - 1),
             (1.0 - with_run - with_text, ms_error, (runs - 1) * (seqs - 1))]
    total = sum(c * ms for c, ms, _ in terms)
    if total <= 0:
        return Interval(mean, 0.0, runs * seqs - 1, runs, seqs, "runs and text")
    df = total ** 2 / sum((c * ms) ** 2 / d for c, ms, d in terms if c)
    half = _t(level, df) * math.sqrt(total / (runs * seqs))
    return Interval(mean, half, df, runs, seqs, "runs and text")


def paired_interval(a, b, level: float = 0.95) -> Interval:
    """``a − b`` for two students on the same runs' data orders and the same text (both R × S)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"a paired comparison needs the same runs and sequences, got {tuple(a.shape)} and {tuple(b.shape)}")
    return crossed_interval(a - b, level)
