"""Measured-oracle allocation helpers: PAV, the log-M curve, greedy allocation, Spearman, measuring."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from dofla.dof.measured import (
    allocate_measured,
    fit_monotone,
    isotonic_nonincreasing,
    lower_envelope,
    measure_layer_curve,
    rank_correlation,
)
from dofla.feature_maps import build_feature_map
from dofla.train import LayerTrainConfig, train_layer

DIMS = [16, 64, 256]


@pytest.mark.parametrize("values, weights, expected", [
    ([5.0, 3.0, 4.0, 1.0], None, [5.0, 3.5, 3.5, 1.0]),
    ([1.0, 3.0, 2.0, 4.0], None, [2.5, 2.5, 2.5, 2.5]),
    ([4.0, 3.0, 3.0, 0.5], None, [4.0, 3.0, 3.0, 0.5]),  # already non-increasing: unchanged
    ([1.0, 4.0], [3.0, 1.0], [1.75, 1.75]),  # weighted mean (3·1 + 1·4) / 4
    # 1 and 3 (weight 3) pool to 2.5 > 2, so all three pool: (2 + 1 + 9) / 5
    ([2.0, 1.0, 3.0, 0.0], [1.0, 1.0, 3.0, 1.0], [2.4, 2.4, 2.4, 0.0]),
])
def test_pav_known_inputs(values, weights, expected):
    assert isotonic_nonincreasing(values, weights) == pytest.approx(expected)


def test_fit_monotone_interpolates_in_log_m_and_is_flat_beyond_ends():
    curve = fit_monotone([256, 16, 64], [0.6, 1.0, 0.5])  # unsorted; 0.5 → 0.6 is an increase
    assert curve.dims == (16.0, 64.0, 256.0)
    assert curve.values == pytest.approx((1.0, 0.55, 0.55))
    assert curve(32) == pytest.approx(1.0 - 0.45 * 0.5)  # halfway between 16 and 64 in log M
    assert curve(1) == curve(16) == 1.0 and curve(4096) == pytest.approx(0.55)
    grid = [curve(m) for m in range(1, 400)]
    assert all(a >= b for a, b in zip(grid, grid[1:]))
    assert fit_monotone([16, 16, 64], [1.0, 0.8, 0.5])(16) == pytest.approx(0.9)  # repeats averaged


def test_fit_monotone_rejects_diverged_losses():
    with pytest.raises(ValueError, match="diverged"):
        fit_monotone(DIMS, [1.0, float("nan"), 0.5])
    with pytest.raises(ValueError, match="one loss per dim"):
        fit_monotone(DIMS, [1.0, 0.5])


def test_lower_envelope_is_the_greatest_convex_minorant():
    values = [3.0, 3.0, 3.0, 1.0, 0.9, 0.0]
    env = lower_envelope(values)
    assert env == pytest.approx([3.0, 7 / 3, 5 / 3, 1.0, 0.5, 0.0])  # vertices at 0, 3 and 5
    assert all(e <= v + 1e-12 for e, v in zip(env, values))
    assert all(env[i - 1] - 2 * env[i] + env[i + 1] >= -1e-12 for i in range(1, len(env) - 1))
    convex = [1 / m for m in range(1, 20)]
    assert lower_envelope(convex) == convex


def test_steep_layer_gets_more_and_total_is_exact():
    steep, shallow = fit_monotone(DIMS, [2.0, 1.0, 0.5]), fit_monotone(DIMS, [1.0, 0.95, 0.9])
    for budget in (64, 63.9, 40.26):
        dims = allocate_measured([shallow, steep, shallow], budget)
        assert sum(dims) == round(3 * budget) and min(dims) >= 1
        assert dims[1] > dims[0] and dims[1] > dims[2]


@pytest.mark.parametrize("quantum", [1, 8])
def test_equal_curves_get_equal_dims(quantum):
    curve = fit_monotone(DIMS, [2.0, 1.2, 0.9])  # flat below 16: raw greedy would see no gain at M = 1
    dims = allocate_measured([curve] * 5, 50.3, quantum=quantum)
    assert sum(dims) == round(5 * 50.3)
    assert max(dims) - min(dims) <= quantum


def test_flat_curve_keeps_min_dim_and_max_dim_is_respected():
    flat, steep = fit_monotone(DIMS, [1.0, 1.0, 1.0]), fit_monotone(DIMS, [2.0, 1.0, 0.5])
    assert allocate_measured([steep, flat], 64) == [127, 1]
    dims = allocate_measured([steep, flat, steep], 64, min_dim=4, max_dim=90)
    assert dims[0] == dims[2] == 90 and dims[1] == 192 - 180


def test_all_flat_curves_spread_evenly():
    flat = fit_monotone(DIMS, [1.0, 1.0, 1.0])
    dims = allocate_measured([flat] * 4, 10.5)
    assert sum(dims) == 42 and max(dims) - min(dims) <= 1


def test_greedy_is_optimal_for_convex_curves():
    """Brute force over every split of the total: greedy reaches the least summed loss."""
    curves = [lambda m, a=a: a / m + 0.01 * a * math.log1p(1 / m) for a in (1.0, 4.0, 9.0)]
    dims = allocate_measured(curves, 10)
    best = min(sum(c(m) for c, m in zip(curves, split))
               for split in itertools.product(range(1, 29), repeat=3) if sum(split) == 30)
    assert sum(dims) == 30 and sum(c(m) for c, m in zip(curves, dims)) == pytest.approx(best)


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": 0}, "budget"),
    ({"budget": 2, "min_dim": 3}, "min_dim=3"),
    ({"budget": 64, "max_dim": 10}, "max_dim=10"),
    ({"budget": 64, "quantum": 0}, "quantum=0"),
])
def test_allocation_errors_name_the_cause(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allocate_measured([fit_monotone(DIMS, [1.0, 0.5, 0.2])] * 2, **kwargs)


def test_rank_correlation():
    # Ranks of b: [1, 2, 3.5, 5, 3.5]; ρ = 8 / sqrt(10 · 9.5) by hand.
    assert rank_correlation([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert rank_correlation([3, 1, 2], [30, 10, 20]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3], [9, 4, 1]) == pytest.approx(-1.0)
    assert math.isnan(rank_correlation([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="equal length"):
        rank_correlation([1, 2], [1, 2, 3])


def test_measure_layer_curve_on_tiny_activations():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 8, 8, generator=g) * 1.5  # (S, H, L, d)
    k = torch.randn(6, 1, 8, 8, generator=g) * 1.5  # (S, H_kv, L, d): GQA, one key head
    cfg = LayerTrainConfig(steps=4, batch_size=2, eval_every=2, warmup_steps=1, seed=3)

    def make(m):
        return build_feature_map("hedgehog", 2, 8, m, seed=1)

    losses = measure_layer_curve(make, q, k, [2, 8, 16], cfg)
    assert len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in losses)
    assert losses[1] == train_layer(make(8), q, k, cfg).final_heldout_loss
    with pytest.raises(ValueError, match="positive integers"):
        measure_layer_curve(make, q, k, [0, 8], cfg)
