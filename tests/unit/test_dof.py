"""Algorithm 1 against the dense trace reference, and the allocation policies' invariants."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.dof import (
    allocate_dims,
    check_degenerate,
    dof_dense_reference,
    dof_from_eigenvalues,
    estimate_layer_dof,
    gram_matrix,
    sample_pool,
)

PAPER_GPT2 = [130, 182, 35, 44, 42, 65, 92, 33, 28, 34, 46, 39]


def _activations(n=300, heads=4, kv_heads=2, d=16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, d, generator=g) * scale, torch.randn(n, kv_heads, d, generator=g) * scale


@pytest.mark.parametrize("method", ["cholesky", "eigh"])
@pytest.mark.parametrize("gram_norm", ["none", "J", "trace"])
def test_fast_routes_equal_dense_trace_reference(gram_norm, method):
    q, k = _activations(scale=0.7)
    per_head, layer = estimate_layer_dof(q, k, lam=1e-2, num_samples=128, gram_norm=gram_norm, seed=3,
                                         method=method)
    g = torch.Generator().manual_seed(3)
    for h in range(q.shape[1]):
        x = sample_pool(q, k, h, 128, g)
        reference = dof_dense_reference(gram_matrix(x, gram_norm), 1e-2)
        assert math.isclose(per_head[h], reference, rel_tol=1e-8)
    assert layer == max(per_head)


def test_known_spectrum():
    c, lam, j = 0.3, 0.1, 50
    assert math.isclose(float(dof_from_eigenvalues(torch.full((j,), c, dtype=torch.float64), lam)),
                        j * c / (c + lam), rel_tol=1e-12)


def test_trace_normalised_dof_decreases_with_lambda():
    q, k = _activations(scale=1.5)
    values = [estimate_layer_dof(q, k, lam, 128, "trace")[1] for lam in (1e-4, 1e-3, 1e-2, 1e-1)]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


def test_paper_form_saturates_at_real_norms_and_warns():
    q, k = _activations(n=400, d=64, scale=2.5)  # |x|²/sqrt(d) ≈ 50, like SmolLM2's layers
    _, layer = estimate_layer_dof(q, k, 2 ** -4, 256, "J")
    assert layer > 0.9 * 256
    assert "saturated" in check_degenerate([layer, layer * 0.99], 256)
    assert check_degenerate([40.0, 18.0, 6.0], 1024) is None
    assert "same DoF" in check_degenerate([10.0, 10.2, 10.1], 1024)


def test_gqa_pool_uses_the_heads_kv_group():
    q, k = _activations(n=10, heads=4, kv_heads=2)
    pool = sample_pool(q, k, 3, 1000, torch.Generator().manual_seed(0))
    assert torch.equal(pool, torch.cat([q[:, 3], k[:, 1]]).double())


def test_fix_is_exact():
    assert allocate_dims([1.0, 5.0, 9.0], 64, "fix", 64) == [64, 64, 64]


def test_dof_mean_matches_budget_and_follows_dof():
    dims = allocate_dims([float(x) for x in PAPER_GPT2], 64, "dof", 64)
    assert abs(sum(dims) / len(dims) - 64) <= 0.5
    order = sorted(range(12), key=lambda i: PAPER_GPT2[i])
    assert [dims[i] for i in order] == sorted(dims)
    assert dims == [round(64 / (sum(PAPER_GPT2) / 12) * n) for n in PAPER_GPT2]


def test_dof_clip_caps_at_head_size():
    dof = allocate_dims([float(x) for x in PAPER_GPT2], 64, "dof", 64)
    clip = allocate_dims([float(x) for x in PAPER_GPT2], 64, "dof_clip", 64)
    assert all(c <= 64 and c <= d for c, d in zip(clip, dof)) and sum(clip) < sum(dof)


@pytest.mark.parametrize("args", [([], 64, "dof"), ([1.0], 0, "dof"), ([-1.0, 2.0], 64, "dof"),
                                  ([1.0], 64, "dof_head_x")])
def test_invalid_allocation_inputs_raise(args):
    layer_dof, budget, policy = args
    with pytest.raises((ValueError, KeyError)):
        allocate_dims(layer_dof, budget, policy, 64)
