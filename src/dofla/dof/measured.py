"""The measured-oracle allocation (beyond the paper): dims from measured loss-vs-M curves.

Instead of predicting each layer's need from its degrees of freedom, train each layer briefly at a
few feature counts (e.g. 16, 64, 256) on the bounded activation sample, fit a non-increasing curve
of held-out loss against M per layer, and share the same total budget as ``dof`` by greedy
marginal gain. ``rank_correlation`` compares the result with the DoF ranking.

Greedy runs on each curve's lower convex envelope in M (sampled at every integer M). Raw greedy on
a curve that is flat below its first measured M (every layer starting at min_dim = 1 < 16) sees no
gain anywhere and hands features out by index alone; on the envelope the first step already sees
the drop to the first measured point, a flat curve keeps min_dim, equal curves get equal dims
(± quantum), and for convex curves greedy is the exact optimum of the summed loss.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dofla.feature_maps.base import FeatureMap
from dofla.train.layerwise import LayerTrainConfig, train_layer

# Gains closer than this (relative) count as a tie: envelope segments are linear, so equal gains
# along one segment differ only by rounding and must not decide who gets the next features.
_TIE_RTOL = 1e-9


def measure_layer_curve(make_feature_map: Callable[[int], FeatureMap], q: torch.Tensor, k: torch.Tensor,
                        dims: Sequence[int], cfg: LayerTrainConfig, v: torch.Tensor | None = None) -> list[float]:
    """Held-out loss after brief layerwise training, one per M in ``dims``.

    ``q`` (S, H, L, d), ``k`` and ``v`` (S, H_kv, L, d) are one layer's cached activations (v
    is read only by a loss that needs values);
    ``make_feature_map(M)`` builds a fresh map with M features; ``cfg`` sets the (short) training.
    """
    if not dims or any(int(m) != m or m < 1 for m in dims):
        raise ValueError(f"measured dims {list(dims)} must be a non-empty list of positive integers")
    losses = []
    for m in dims:
        result = train_layer(make_feature_map(int(m)), q, k, cfg, desc=f"M={int(m)}", v=v)
        losses.append(float(result.final_heldout_loss))
    return losses


def isotonic_nonincreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least-squares non-increasing fit (pool-adjacent-violators), same length as ``values``."""
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    blocks: list[list[float]] = []  # [weighted sum, total weight, count] per pooled block
    for value, weight in zip(values, weights):
        blocks.append([value * weight, weight, 1])
        # Pool while the previous block's mean is below the last one's (an increase).
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
            total, weight_sum, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight_sum
            blocks[-1][2] += count
    return [total / weight_sum for total, weight_sum, count in blocks for _ in range(count)]


@dataclass(frozen=True)
class MonotoneCurve:
    """Non-increasing loss(M): linear in log M between ``dims`` (ascending), flat beyond the ends."""

    dims: tuple[float, ...]
    values: tuple[float, ...]

    def __call__(self, m: float) -> float:
        if m <= self.dims[0]:
            return self.values[0]
        if m >= self.dims[-1]:
            return self.values[-1]
        i = bisect.bisect_right(self.dims, m)
        (x0, x1), (y0, y1) = self.dims[i - 1:i + 1], self.values[i - 1:i + 1]
        t = (math.log(m) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + (y1 - y0) * t


def fit_monotone(dims: Sequence[float], losses: Sequence[float]) -> MonotoneCurve:
    """Isotonic (non-increasing) fit of ``losses`` measured at ``dims``, interpolated in log M.

    Repeated dims are averaged first (weighted by their count), so the fit is a function of M.
    """
    if len(dims) != len(losses) or not dims:
        raise ValueError(f"fit_monotone needs one loss per dim, got {len(dims)} dims and {len(losses)} losses")
    if any(not (math.isfinite(m) and m > 0) for m in dims):
        raise ValueError(f"measured dims {list(dims)} must be positive feature counts")
    if any(not math.isfinite(v) for v in losses):
        raise ValueError(f"measured losses {list(losses)} contain NaN/inf; the short training diverged "
                         "(lower the learning rates or check the activations)")
    pooled: dict[float, list[float]] = {}
    for m, v in zip(dims, losses):
        pooled.setdefault(float(m), []).append(float(v))
    xs = sorted(pooled)
    means = [sum(pooled[x]) / len(pooled[x]) for x in xs]
    fitted = isotonic_nonincreasing(means, [len(pooled[x]) for x in xs])
    return MonotoneCurve(tuple(xs), tuple(fitted))


def lower_envelope(values: Sequence[float]) -> list[float]:
    """The greatest convex sequence below ``values`` (points (i, values[i])), at every i."""
    hull: list[int] = []
    for i, y in enumerate(values):
        # Drop the last vertex while it lies on or above the chord from its predecessor to i.
        while len(hull) > 1:
            a, b = hull[-2], hull[-1]
            if (values[b] - values[a]) * (i - a) >= (y - values[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(i)
    out = list(values)
    for a, b in zip(hull, hull[1:]):
        for i in range(a + 1, b):
            out[i] = values[a] + (values[b] - values[a]) * (i - a) / (b - a)
    return out


def allocate_measured(curves: Sequence[Callable[[float], float]], budget: float, min_dim: int = 1,
                      max_dim: int | None = None, quantum: int = 1) -> list[int]:
    """Per-layer dims summing to round(L × budget), by greedy marginal gain on the curves.

    Every layer starts at ``min_dim``; each step gives ``quantum`` features (the last step the
    remainder, so the total is exact) to the layer whose loss envelope drops most per feature; ties
    go to the layer with fewer features, then the lower index. Layers stop at ``max_dim``. When no
    layer gains any more (the budget reaches past every curve's last measured M), the rest is spread
    evenly by that tie-break.
    """
    num_layers = len(curves)
    target = _check_allocation(num_layers, budget, min_dim, max_dim, quantum)
    top = max_dim if max_dim is not None else target - (num_layers - 1) * min_dim
    envelopes = [lower_envelope([float(c(m)) for m in range(min_dim, top + 1)]) for c in curves]
    dims = [min_dim] * num_layers
    remaining = target - num_layers * min_dim
    while remaining > 0:
        options = []
        for layer, (m, env) in enumerate(zip(dims, envelopes)):
            step = min(quantum, remaining, top - m)
            if step > 0:
                options.append(((env[m - min_dim] - env[m + step - min_dim]) / step, m, layer, step))
        best_gain = max(gain for gain, *_ in options)
        tol = _TIE_RTOL * max(abs(best_gain), 1e-300)
        _, m, layer, step = min((o for o in options if o[0] >= best_gain - tol), key=lambda o: (o[1], o[2]))
        dims[layer] += step
        remaining -= step
    return dims


def _check_allocation(num_layers: int, budget: float, min_dim: int, max_dim: int | None, quantum: int) -> int:
    """The exact total round(L × budget), after one-sentence checks of every argument."""
    if num_layers == 0:
        raise ValueError("allocate_measured got no curves; measure at least one layer first")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget={budget} is not valid; it must be a positive mean feature dimension "
                         "per layer")
    if min_dim < 1 or quantum < 1:
        raise ValueError(f"min_dim={min_dim} and quantum={quantum} must both be positive numbers of features")
    target = round(num_layers * budget)
    if num_layers * min_dim > target:
        raise ValueError(f"min_dim={min_dim} for {num_layers} layers exceeds the total budget {target}; "
                         "lower min_dim or raise the budget")
    if max_dim is not None and (max_dim < min_dim or num_layers * max_dim < target):
        raise ValueError(f"max_dim={max_dim} cannot hold the total budget {target} over {num_layers} layers "
                         f"(or is below min_dim={min_dim}); raise max_dim")
    return target


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ (Pearson correlation of average ranks); NaN when either side is constant."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"rank_correlation needs two sequences of equal length ≥ 2, got lengths "
                         f"{len(a)} and {len(b)}")
    ra, rb = _ranks(a), _ranks(b)
    mean = (len(a) + 1) / 2  # average ranks always have this mean
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var_a = sum((x - mean) ** 2 for x in ra)
    var_b = sum((y - mean) ** 2 for y in rb)
    if var_a == 0 or var_b == 0:
        return float("nan")
    return cov / math.sqrt(var_a * var_b)
