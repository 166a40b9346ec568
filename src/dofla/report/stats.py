"""Small-sample statistics for comparing seeds: Student-t intervals, paired differences, gap closed.

No scipy: the t distribution's CDF for integer degrees of freedom has a closed form (a finite sum
in θ = atan(t / √ν)), and its quantile is found by bisection on that CDF.
"""
from __future__ import annotations

import math

# Beyond this many degrees of freedom the normal quantile is used (t differs from it by < 0.2 %).
NORMAL_DF = 1000


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with integer ``df`` ≥ 1 (exact finite sum, no special functions)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    if t < 0:
        return 1.0 - t_cdf(-t, df)
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/π)(θ + sinθ cosθ (1 + 2/3 c² + 2·4/(3·5) c⁴ + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = (2 / math.pi) * (theta + s * math.cos(theta) * total)
    else:  # even: sinθ (1 + 1/2 c² + 1·3/(2·4) c⁴ + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    return 0.5 * (1.0 + inside)


def normal_quantile(p: float) -> float:
    """Standard normal quantile by bisection on Φ(x) = (1 + erf(x / √2)) / 2."""
    return _bisect(lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))), p)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (normal beyond NORMAL_DF)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile level must be in (0, 1), got {p}")
    if df > NORMAL_DF:
        return normal_quantile(p)
    return _bisect(lambda x: t_cdf(x, df), p)


def _bisect(cdf, p: float) -> float:
    if p < 0.5:
        return -_bisect(cdf, 1.0 - p)
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


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


def welch_ci(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, int]:
    """mean(a) − mean(b), the half-width of its two-sided Welch interval, and the degrees of freedom
    used: two unpaired groups (say, three training runs of each arm, not matched run for run), each
    with its own variance. The Welch–Satterthwaite degrees of freedom are rounded down (at least 1),
    which widens the interval slightly: :func:`t_quantile` takes whole degrees of freedom."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"an unpaired interval needs at least two values per group, got {len(a)} and {len(b)}")
    (mean_a, var_a), (mean_b, var_b) = _mean_var(a), _mean_var(b)
    va, vb, diff = var_a / len(a), var_b / len(b), mean_a - mean_b
    if va + vb == 0:
        return diff, 0.0, len(a) + len(b) - 2
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    whole = max(1, math.floor(df + 1e-9))
    return diff, t_quantile(0.5 + level / 2, whole) * math.sqrt(va + vb), whole


def paired_differences(policy: dict, reference: dict) -> dict:
    """Per key (a seed) present in both: ``policy[key] − reference[key]``, in sorted key order."""
    return {k: policy[k] - reference[k] for k in sorted(set(policy) & set(reference))}


def gap_closed(loss_ref: float, loss: float, loss_teacher: float) -> float | None:
    """Share of the reference→teacher gap closed, (loss_ref − loss) / (loss_ref − loss_teacher);
    None when the reference already equals the teacher (no gap to close)."""
    gap = loss_ref - loss_teacher
    return (loss_ref - loss) / gap if gap else None
