"""Small-sample statistics for comparing seeds: Student-t intervals, paired differences, gap closed.

Quantiles come from ``scipy.stats.t``, which takes fractional degrees of freedom (Welch's).
"""
from __future__ import annotations

import math

from scipy import stats


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (> 0, possibly fractional) degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile level must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return float(stats.t.ppf(p, df))


def _mean_var(values: list[float]) -> tuple[float, float]:
    """Mean and sample variance (n − 1 in the denominator) of at least two values."""
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float | None]:
    """Mean and the half-width of its two-sided Student-t interval, t(1 − α/2, n − 1) · s / √n,
    with s the sample standard deviation; the half-width is None for a single value."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_ci needs at least one value")
    n = len(values)
    if n == 1:
        return values[0], None
    mean, var = _mean_var(values)
    return mean, t_quantile(0.5 + level / 2, n - 1) * math.sqrt(var / n)


def welch_ci(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) − mean(b), the half-width of its two-sided Welch interval, and the Welch–Satterthwaite
    degrees of freedom it used (fractional, not rounded): two unpaired groups (say, three training runs
    of each arm, not matched run for run), each with its own variance."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"an unpaired interval needs at least two values per group, got {len(a)} and {len(b)}")
    (mean_a, var_a), (mean_b, var_b) = _mean_var(a), _mean_var(b)
    va, vb, diff = var_a / len(a), var_b / len(b), mean_a - mean_b
    if va + vb == 0:
        return diff, 0.0, float(len(a) + len(b) - 2)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, t_quantile(0.5 + level / 2, df) * math.sqrt(va + vb), df


def paired_differences(policy: dict, reference: dict) -> dict:
    """Per key (a seed) present in both: ``policy[key] − reference[key]``, in sorted key order."""
    return {k: policy[k] - reference[k] for k in sorted(set(policy) & set(reference))}


def gap_closed(loss_ref: float, loss: float, loss_teacher: float) -> float | None:
    """Share of the reference→teacher gap closed, (loss_ref − loss) / (loss_ref − loss_teacher);
    None when the reference already equals the teacher (no gap to close)."""
    gap = loss_ref - loss_teacher
    return (loss_ref - loss) / gap if gap else None
