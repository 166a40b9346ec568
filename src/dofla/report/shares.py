"""Intervals for shares: how many of a fixed set of trials (passkey prompts, MQAR queries) a model got right.

A share is a count out of n, so a normal (t) interval misstates it: at 0 of 300 it has no width, near 0
its lower end goes negative. A share's interval here is Wilson's score interval (``scipy.stats.binomtest``),
which stays inside [0, 1] and has width at 0 of n. Two students scored on the same trials are compared
trial by trial: the difference of their shares with Newcombe's interval for paired proportions (his
method 10: Wilson's interval for each share, combined through the correlation of the pairs) and
McNemar's exact test on the discordant trials (a binomial test of "only A" against "only B").

Trials pooled over several training runs are counted as one sample of n = runs × trials: the interval
counts the trials, not how much the share moves from one training run to the next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats


def digits(low: float, high: float, fewest: int = 2, most: int = 4) -> int:
    """Decimals enough for the interval's ends to print apart and for an end that is not 0 not to print as 0
    (a share near 0 of many trials has a narrow interval that two decimals would print as [0.00, 0.00])."""
    def shown(x: float, d: int) -> bool:
        return x == 0 or round(abs(x), d) > 0

    for d in range(fewest, most):
        if f"{low:.{d}f}" != f"{high:.{d}f}" and shown(low, d) and shown(high, d):
            return d
    return most


@dataclass(frozen=True)
class ShareInterval:
    """``hits`` of ``trials`` and the two ends of its Wilson interval."""

    hits: int
    trials: int
    low: float
    high: float

    @property
    def share(self) -> float:
        return self.hits / self.trials

    def __str__(self) -> str:
        d = digits(self.low, self.high)
        return f"{self.share:.{d}f} [{self.low:.{d}f}, {self.high:.{d}f}]"


@dataclass(frozen=True)
class PairedShareInterval:
    """A − B on the same trials: the four cells of the paired table, Newcombe's interval and McNemar's p."""

    both: int
    only_a: int
    only_b: int
    neither: int
    low: float
    high: float
    p_value: float  # McNemar's exact two-sided test: only_a against only_b

    @property
    def trials(self) -> int:
        return self.both + self.only_a + self.only_b + self.neither

    @property
    def difference(self) -> float:
        return (self.only_a - self.only_b) / self.trials

    def __str__(self) -> str:
        d = digits(self.low, self.high)
        return f"{self.difference:+.{d}f} [{self.low:+.{d}f}, {self.high:+.{d}f}]"


def counts(values, per_value: int = 1) -> torch.Tensor:
    """The whole number of hits in each value of ``values`` (any shape): 0/1 per trial (``per_value`` 1),
    or a share of ``per_value`` trials each (an MQAR example's share of its T/4 queries)."""
    x = torch.as_tensor(values, dtype=torch.float64) * per_value
    hits = x.round()
    if x.numel() == 0 or (x - hits).abs().max() > 1e-6 * per_value or hits.min() < 0 or hits.max() > per_value:
        raise ValueError(f"values must be shares of {per_value} trial(s) each, whole counts between 0 and {per_value}")
    return hits.long()


def wilson(hits: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for ``hits`` of ``trials`` (scipy's)."""
    ci = stats.binomtest(int(hits), int(trials)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def share_interval(values, per_value: int = 1, level: float = 0.95) -> ShareInterval:
    """The share of hits in ``values`` (runs × trials of 0/1, or shares of ``per_value`` trials each), pooled."""
    hits = counts(values, per_value)
    n, k = hits.numel() * per_value, int(hits.sum())
    return ShareInterval(k, n, *wilson(k, n, level))


def paired_counts(a, b, per_value: int = 1) -> tuple[int, int, int, int] | None:
    """(both, only A, only B, neither) over the paired trials of ``a`` and ``b`` (the same shape). With shares
    of several trials per value the cells are known only where one of the two hit none or all of them;
    None when some value leaves them open."""
    x, y = counts(a, per_value), counts(b, per_value)
    if x.shape != y.shape:
        raise ValueError(f"a paired comparison needs the same trials, got {tuple(x.shape)} and {tuple(y.shape)}")
    low, high = torch.minimum(x, y), torch.maximum(x, y)
    if per_value > 1 and not ((low == 0) | (high == per_value)).all():
        return None
    both = torch.where(high == per_value, low, 0)  # one hit every trial: the other's hits are shared
    only_a, only_b = x - both, y - both
    n = x.numel() * per_value
    cells = int(both.sum()), int(only_a.sum()), int(only_b.sum())
    return (*cells, n - sum(cells))


def _correlation(both: int, only_a: int, only_b: int, neither: int) -> float:
    """Newcombe's estimate of the correlation of the two shares: the table's phi coefficient, its positive
    cross-product shrunk by n/2 (a continuity correction; 0 when that leaves nothing), 0 with an empty margin."""
    n = both + only_a + only_b + neither
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b
    if margins == 0:
        return 0.0
    return (max(0.0, cross - n / 2) if cross >= 0 else cross) / math.sqrt(margins)


def newcombe_paired(both: int, only_a: int, only_b: int, neither: int, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's (1998) method 10 interval for p_A − p_B from a paired 2 × 2 table."""
    n = both + only_a + only_b + neither
    p_a, p_b = (both + only_a) / n, (both + only_b) / n
    (l_a, u_a), (l_b, u_b) = wilson(both + only_a, n, level), wilson(both + only_b, n, level)
    phi = _correlation(both, only_a, only_b, neither)
    down = math.sqrt(max(0.0, (p_a - l_a) ** 2 - 2 * phi * (p_a - l_a) * (u_b - p_b) + (u_b - p_b) ** 2))
    up = math.sqrt(max(0.0, (u_a - p_a) ** 2 - 2 * phi * (u_a - p_a) * (p_b - l_b) + (p_b - l_b) ** 2))
    diff = p_a - p_b
    return max(-1.0, diff - down), min(1.0, diff + up)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """McNemar's exact two-sided p-value: the discordant trials as a binomial test at 1/2 (1 with none)."""
    discordant = only_a + only_b
    return 1.0 if discordant == 0 else float(stats.binomtest(only_a, discordant, 0.5).pvalue)


def paired_share_interval(a, b, per_value: int = 1, level: float = 0.95) -> PairedShareInterval | None:
    """A − B over the same trials (see :func:`paired_counts`); None when the paired cells are not known."""
    cells = paired_counts(a, b, per_value)
    if cells is None:
        return None
    return PairedShareInterval(*cells, *newcombe_paired(*cells, level), mcnemar_exact(cells[1], cells[2]))
