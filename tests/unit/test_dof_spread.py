"""Head aggregation and the J-sample spread of Algorithm 1."""
from __future__ import annotations

import pytest
import torch

from dofla.dof.algorithm import aggregate_heads, estimate_layer_dof, estimate_layer_dof_averaged, layer_dof_spread


def _activations(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.3, 1.0, 2.0, 3.0])[None, :, None]  # heads of different kernel spread
    return torch.randn(400, 4, 16, generator=g) * scales, torch.randn(400, 2, 16, generator=g)


def test_aggregates_of_head_values():
    assert aggregate_heads([1.0, 4.0, 2.0], "max") == 4.0
    assert aggregate_heads([1.0, 4.0, 2.0], "mean") == pytest.approx(7 / 3)
    assert aggregate_heads([1.0, 4.0, 2.0], "median") == 2.0
    with pytest.raises(ValueError, match="aggregate='sum' is not valid"):
        aggregate_heads([1.0], "sum")


def test_layer_value_is_the_aggregate_of_the_per_head_values():
    q, k = _activations()
    for aggregate in ("max", "mean", "median"):
        heads, value = estimate_layer_dof(q, k, 1e-2, 128, seed=3, aggregate=aggregate)
        assert value == pytest.approx(aggregate_heads(heads, aggregate))


def test_spread_collects_one_value_per_sample_and_vanishes_when_j_covers_the_pool():
    q, k = _activations(1)
    small = layer_dof_spread(q, k, 1e-2, 32, seeds=range(6))
    assert len(small["values"]) == 6 and small["std"] > 0 and small["rel_spread"] > 0
    assert small["values"] == [estimate_layer_dof(q, k, 1e-2, 32, seed=s)[1] for s in range(6)]
    with pytest.warns(UserWarning, match="fewer than num_samples"):
        whole = layer_dof_spread(q, k, 1e-2, 800, seeds=range(3))  # every seed samples the whole pool
    assert whole["std"] == pytest.approx(0.0, abs=1e-9) and whole["rel_spread"] == pytest.approx(0.0, abs=1e-9)


def test_averaged_estimate_is_the_mean_of_single_samples_and_moves_less():
    q, k = _activations()
    one_heads, one_value = estimate_layer_dof(q, k, 1e-2, 32, seed=5, aggregate="mean")
    heads, value, samples = estimate_layer_dof_averaged(q, k, 1e-2, 32, seeds=[5], aggregate="mean")
    assert heads == pytest.approx(one_heads) and value == pytest.approx(one_value) and samples == [one_value]
    singles = [estimate_layer_dof(q, k, 1e-2, 32, seed=s, aggregate="max") for s in range(4)]
    heads, value, samples = estimate_layer_dof_averaged(q, k, 1e-2, 32, seeds=range(4), aggregate="max")
    assert heads == pytest.approx(torch.tensor([h for h, _ in singles], dtype=torch.float64).mean(0).tolist())
    assert value == pytest.approx(max(heads)) and samples == pytest.approx([v for _, v in singles])
    means = [estimate_layer_dof_averaged(q, k, 1e-2, 32, seeds=range(8 * r, 8 * r + 8))[1] for r in range(6)]
    ones = [estimate_layer_dof(q, k, 1e-2, 32, seed=100 + r)[1] for r in range(6)]
    assert torch.tensor(means).std() < torch.tensor(ones).std()  # a mean of 8 samples is steadier than one
