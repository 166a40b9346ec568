"""studies/dof_stability.py: spread of the layer DoF and of the dims allocated from it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from studies.dof_stability import average_groups, measure, pick, rel_spread, resample_per_head, stability, within
from dofla.dof.algorithm import aggregate_heads
from dofla.dof.allocate import allocate_dims

SCALES = (0.4, 1.0, 1.8)  # one activation scale per layer, so the layers' DoF differ


def _layer(i: int, n: int = 1500):
    """(index, q (n, 2, 16), k (n, 1, 16)) of a synthetic layer with activation scale SCALES[i]."""
    g = torch.Generator().manual_seed(100 + i)
    return i, torch.randn(n, 2, 16, generator=g) * SCALES[i], torch.randn(n, 1, 16, generator=g) * SCALES[i]


def test_spread_and_within_on_known_values():
    x = np.array([[10.0, 4.0, 0.0], [12.0, 4.0, 0.0], [8.0, 4.0, 0.0]])
    assert rel_spread(x) == pytest.approx([0.4, 0.0, 0.0])
    assert within(x, 0.10).tolist() == [False, True, True]
    assert within(x, 0.25).tolist() == [True, True, True]


def test_identical_seeds_give_zero_spread_and_dims_from_the_dof_policy():
    per_head = np.stack([resample_per_head(q, k, 1e-2, 64, "trace", 3, seeds=[7, 7, 7]) for _, q, k in
                         map(_layer, range(3))], axis=1)  # (R, L, H)
    s = stability(per_head, "max", budget=16, head_dim=16)
    assert np.all(s["dof_spread"] == 0) and np.all(s["dim_spread"] == 0) and s["share_within"] == 1.0
    layer_dof = [aggregate_heads(list(h), "max") for h in per_head[0]]
    assert s["dims"][0].tolist() == allocate_dims(layer_dof, 16, "dof", 16)
    # the layers differ, and the layer with more DoF gets more features
    assert len(set(s["dims"][0])) == 3 and np.argsort(s["dims"][0]).tolist() == np.argsort(layer_dof).tolist()


def test_spread_shrinks_as_j_grows():
    finished = []  # rows known after each J
    rows = measure(list(map(_layer, range(3))), 1e-2, [24, 384], {24: 5, 384: 5}, "trace", budget=16,
                   head_dim=16, aggregates=("max", "mean"), done=lambda so_far: finished.append(len(so_far)))
    assert finished == [2, 4]
    assert [(r["J"], r["aggregate"], r["R"]) for r in rows] == [(24, "max", 5), (24, "mean", 5),
                                                                 (384, "max", 5), (384, "mean", 5)]
    for aggregate in ("max", "mean"):
        small, large = (next(r["stats"] for r in rows if r["J"] == j and r["aggregate"] == aggregate)
                        for j in (24, 384))
        assert np.median(large["dof_spread"]) < 0.5 * np.median(small["dof_spread"])
        assert large["median_dim_spread"] < small["median_dim_spread"]
        assert large["dof"].shape == (5, 3)


def test_pick_takes_the_smallest_stable_j_or_none():
    def row(j, share, median):
        return {"J": j, "aggregate": "max", "stats": {"share_within": share, "median_dim_spread": median}}

    rows = [row(256, 0.5, 0.2), row(512, 0.9, 0.08), row(512, 0.85, 0.05), row(1024, 1.0, 0.02)]
    assert pick(rows) is rows[2]
    assert pick(rows[:1]) is None


def test_average_groups_are_means_of_consecutive_samples_and_steady_the_estimate():
    rng = np.random.default_rng(0)
    per_head = rng.normal(10.0, 2.0, size=(12, 3, 4))  # (R, L, H) independent noisy estimates
    grouped = average_groups(per_head, 4)
    assert grouped.shape == (3, 3, 4)
    np.testing.assert_allclose(grouped[1], per_head[4:8].mean(0))
    assert grouped.std(0).mean() < per_head.std(0).mean()  # a mean of 4 moves less than one sample
    with pytest.raises(ValueError, match="cannot make one average"):
        average_groups(per_head, 13)
