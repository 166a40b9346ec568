"""Algorithm 1 against the dense trace reference, and the allocation policies' invariants."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from dofla.dof import (
    allocate_dims,
    allocate_head_dims,
    check_degenerate,
    dof_by_cholesky,
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full pool never warns
        sample_pool(q, k, 0, 128, torch.Generator())
    for h in range(q.shape[1]):
        x = sample_pool(q, k, h, 128, g)
        reference = dof_dense_reference(gram_matrix(x, gram_norm), 1e-2)
        assert math.isclose(per_head[h], reference, rel_tol=1e-8)
    assert layer == max(per_head)


def test_known_spectrum():
    c, lam, j = 0.3, 0.1, 50
    expected = j * c / (c + lam)
    assert math.isclose(float(dof_from_eigenvalues(torch.full((j,), c, dtype=torch.float64), lam)),
                        expected, rel_tol=1e-12)
    gram = c * torch.eye(j, dtype=torch.float64)
    assert math.isclose(dof_dense_reference(gram, lam), expected, rel_tol=1e-12)
    assert math.isclose(float(dof_by_cholesky(gram, lam)), expected, rel_tol=1e-12)
    assert float(dof_from_eigenvalues(torch.tensor([-1e-18, 0.0], dtype=torch.float64), lam)) == 0.0


@pytest.mark.parametrize("method", ["cholesky", "eigh"])
def test_batched_heads_equal_one_head_at_a_time(method):
    q, k = _activations(heads=6, kv_heads=3, scale=0.9)
    per_head, _ = estimate_layer_dof(q, k, 1e-3, 96, "trace", seed=5, method=method)
    g = torch.Generator().manual_seed(5)
    for h in range(6):
        gram = gram_matrix(sample_pool(q, k, h, 96, g), "trace")
        if method == "eigh":
            alone = dof_from_eigenvalues(torch.linalg.eigvalsh(gram), 1e-3)
        else:
            alone = dof_by_cholesky(gram, 1e-3)
        assert math.isclose(per_head[h], float(alone), rel_tol=1e-10)


def test_memmap_fp16_input_equals_tensor_input(tmp_path):
    q, k = _activations(n=200, d=8)
    path = tmp_path / "q.npy"
    np.save(path, q.half().numpy())
    q_map = np.load(path, mmap_mode="r")
    from_map = estimate_layer_dof(q_map, k.half().numpy(), 1e-2, 64, "trace", seed=1)
    from_tensor = estimate_layer_dof(q.half(), k.half(), 1e-2, 64, "trace", seed=1)
    assert from_map == from_tensor


def test_trace_normalised_dof_decreases_with_lambda():
    q, k = _activations(scale=1.5)
    values = [estimate_layer_dof(q, k, lam, 128, "trace")[1] for lam in (1e-4, 1e-3, 1e-2, 1e-1)]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


def test_paper_form_saturates_at_real_norms_and_warns():
    q, k = _activations(n=400, d=64, scale=2.5)  # |x|²/sqrt(d) ≈ 50, like SmolLM2's layers
    _, layer = estimate_layer_dof(q, k, 2 ** -4, 256, "J")
    assert layer > 0.9 * 256
    assert "saturated" in check_degenerate([layer, layer * 0.99], 256)
    assert "gram_norm=trace" in check_degenerate([layer, layer * 0.99], 256)
    assert "same DoF" in check_degenerate([10.0, 10.2, 10.1], 1024)
    assert check_degenerate([10.0], 1024) is None  # one layer: dof = fix is no degeneracy


def test_well_spread_layers_do_not_warn():
    g = torch.Generator().manual_seed(1)
    layers = []
    for scale in (0.6, 1.0, 1.6):  # larger norms: a more peaked kernel, fewer degrees of freedom
        q, k = torch.randn(400, 2, 32, generator=g) * scale, torch.randn(400, 1, 32, generator=g) * scale
        layers.append(estimate_layer_dof(q, k, 1e-2, 256, "trace")[1])
    assert layers == sorted(layers, reverse=True) and layers[-1] < 0.5 * layers[0]
    assert check_degenerate(layers, 256) is None


def test_gqa_pool_uses_the_heads_kv_group_and_warns_when_short():
    q, k = _activations(n=10, heads=4, kv_heads=2)
    with pytest.warns(UserWarning, match="fewer than num_samples=1000"):
        pool = sample_pool(q, k, 3, 1000, torch.Generator().manual_seed(0))
    assert torch.equal(pool, torch.cat([q[:, 3], k[:, 1]]).double())


def test_fix_is_exact():
    assert allocate_dims([1.0, 5.0, 9.0], 64, "fix", 64) == [64, 64, 64]


@pytest.mark.parametrize("budget", [16, 64, 100.0])
def test_fix_max_gives_every_layer_the_largest_dof_dim(budget):
    dof = allocate_dims([float(x) for x in PAPER_GPT2], budget, "dof", 64)
    fix_max = allocate_dims([float(x) for x in PAPER_GPT2], budget, "fix_max", 64)
    assert fix_max == [max(dof)] * 12 and max(dof) > budget  # dearer than the budget: an upper reference
    assert allocate_dims([3.0, 3.0], 64, "fix_max", 64) == [64, 64]  # equal DoF: fix_max = dof = fix
    assert allocate_dims([float(x) for x in PAPER_GPT2], 64, "fix_max", 64)[0] == 182  # GPT-2's layer 1


@pytest.mark.parametrize("seed", range(5))
def test_dof_mean_within_rounding_and_monotone(seed):
    g = torch.Generator().manual_seed(seed)
    layer_dof = (torch.rand(16, generator=g) * 200 + 1).tolist()
    for budget in (16, 64, 100.0):
        dims = allocate_dims(layer_dof, budget, "dof", 64)
        assert abs(sum(dims) / len(dims) - budget) <= 0.5 + 1e-9
        order = sorted(range(16), key=lambda i: layer_dof[i])
        assert [dims[i] for i in order] == sorted(dims)


def test_paper_gpt2_row_is_reproduced_from_its_relative_profile():
    dims = allocate_dims([n / 7.3 for n in PAPER_GPT2], 64, "dof", 64)  # only ratios matter
    assert dims == PAPER_GPT2 and abs(sum(dims) / 12 - 64) <= 0.5
    clip = allocate_dims([n / 7.3 for n in PAPER_GPT2], 64, "dof_clip", 64)
    assert round(sum(clip) / 12, 1) == 46.4  # the paper's dof_clip mean on GPT-2


def test_dof_clip_caps_at_head_size():
    dof = allocate_dims([float(x) for x in PAPER_GPT2], 64, "dof", 64)
    clip = allocate_dims([float(x) for x in PAPER_GPT2], 64, "dof_clip", 64)
    assert all(c <= 64 and c <= d for c, d in zip(clip, dof)) and sum(clip) < sum(dof)


@pytest.mark.parametrize("args", [([], 64, "dof", 64), ([1.0], 0, "dof", 64), ([1.0], -3, "fix", 64),
                                  ([1.0], float("nan"), "dof", 64), ([-1.0, 2.0], 64, "dof", 64),
                                  ([float("nan"), 2.0], 64, "dof", 64), ([0.0, 0.0], 64, "dof", 64),
                                  ([1.0], 64, "dof_clip", 0), ([0.0, 0.0], 64, "fix_max", 64),
                                  ([], 64, "fix_max", 64)])
def test_invalid_allocation_inputs_raise(args):
    layer_dof, budget, policy, head_dim = args
    with pytest.raises(ValueError):
        allocate_dims(layer_dof, budget, policy, head_dim)


@pytest.mark.parametrize("seed", range(3))
def test_dof_head_is_proportional_per_head_in_quanta(seed):
    g = torch.Generator().manual_seed(seed)
    per_head = (torch.rand(12, 9, generator=g) * 50 + 1).tolist()
    dims = allocate_head_dims(per_head, 64, 64, quantum=8)
    flat, dof = [m for layer in dims for m in layer], [n for layer in per_head for n in layer]
    assert all(m % 8 == 0 and m >= 8 for m in flat)
    assert abs(sum(flat) / len(flat) - 64) <= 4  # rounding to a quantum: within half of one
    order = sorted(range(len(dof)), key=dof.__getitem__)
    assert [flat[i] for i in order] == sorted(flat)  # more DoF never gets fewer features
    # quantum 1 is the layer rule applied to heads: every head at its own t⁻¹·N
    assert allocate_head_dims([[2.0, 6.0], [4.0, 4.0]], 16, 64, quantum=1) == [[8, 24], [16, 16]]


@pytest.mark.parametrize("seed", range(3))
def test_dof_head_blocks_limit_distinct_dims_and_keep_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    per_head = (torch.rand(12, 9, generator=g) ** 3 * 80 + 1).tolist()
    free = allocate_head_dims(per_head, 64, 64, quantum=1)
    for blocks in (1, 2, 3):
        dims = allocate_head_dims(per_head, 64, 64, quantum=1, max_blocks=blocks)
        assert all(len(set(layer)) <= blocks for layer in dims)
        assert abs(sum(map(sum, dims)) / 108 - 64) <= 0.5  # group means keep the total
        for layer, ideal in zip(dims, free):  # grouping never reorders heads
            order = sorted(range(9), key=ideal.__getitem__)
            assert [layer[h] for h in order] == sorted(layer)
    # the least-squares split: the three small heads together, the two large ones together
    assert allocate_head_dims([[10.0, 100.0, 11.0, 102.0, 12.0]], 47, 64, quantum=1, max_blocks=2) == [
        [11, 101, 11, 101, 11]]


@pytest.mark.parametrize("args", [([], 64, 64, 8), ([[1.0]], 0, 64, 8), ([[-1.0, 2.0]], 64, 64, 8),
                                  ([[0.0, 0.0]], 64, 64, 8), ([[1.0]], 64, 64, 0), ([[1.0]], 64, 64, 8, -1)])
def test_invalid_head_allocation_inputs_raise(args):
    with pytest.raises(ValueError):
        allocate_head_dims(*args)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(KeyError, match="did you mean 'dof_clip'.*valid: budget, dof, dof_clip, dof_head, fix, fix_max, given, measured"):
        allocate_dims([1.0], 64, "dof_clp", 64)


def test_every_policy_is_chosen_through_the_registry():
    """One dispatch for all policies: per-layer ones, the per-head one and measured (its hook)."""
    from dofla.dof import AllocationRequest, choose_dims, reads_dof

    request = AllocationRequest(budget=16, head_dim=16, num_layers=2, layer_dof=[1.0, 3.0],
                                per_head_dof=[[1.0, 1.0], [3.0, 3.0]], head_quantum=4, head_blocks=1,
                                measure=lambda budget, dof: {"dims": [4, 28], "sensitivity": [0.1, 0.9]})
    assert choose_dims("fix", AllocationRequest(budget=16, head_dim=16, num_layers=2)) == ([16, 16], {})
    assert choose_dims("dof", request) == ([8, 24], {})
    assert choose_dims("dof_clip", request) == ([8, 16], {})
    assert choose_dims("dof_head", request) == ([[8, 8], [24, 24]], {})
    assert choose_dims("measured", request) == ([4, 28], {"dims": [4, 28], "sensitivity": [0.1, 0.9]})
    assert choose_dims("dof", AllocationRequest(budget=16, head_dim=16, num_layers=0)) == ([], {})
    assert choose_dims("given", AllocationRequest(budget=16, head_dim=16, num_layers=2, given=[96, 8])) == ([96, 8], {})
    with pytest.raises(ValueError, match="one dim per layer that gets features \\(2\\); allocation.dims gives 3"):
        choose_dims("given", AllocationRequest(budget=16, head_dim=16, num_layers=2, given=[96, 8, 8]))
    policies = ("fix", "dof", "dof_clip", "dof_head", "fix_max", "measured", "given")
    assert [p for p in policies if not reads_dof(p)] == ["fix", "given"]
    with pytest.raises(ValueError, match="per-head DoF"):
        choose_dims("dof_head", AllocationRequest(budget=16, head_dim=16, num_layers=2, layer_dof=[1.0, 3.0]))
    with pytest.raises(ValueError, match="no per-layer form"):
        allocate_dims([1.0], 64, "dof_head", 64)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(lam=0.0), "lambda > 0"), (dict(num_samples=0), "num_samples"),
    (dict(gram_norm="max"), "none, J, trace"), (dict(method="svd"), "cholesky"),
])
def test_invalid_dof_inputs_raise(kwargs, needle):
    q, k = _activations()
    args = dict(lam=1e-2, num_samples=32, gram_norm="trace") | kwargs
    with pytest.raises(ValueError, match=needle):
        estimate_layer_dof(q, k, **args)
    with pytest.raises(ValueError, match="none, J, trace"):
        gram_matrix(torch.zeros(2, 2), "J/2")


def test_bad_shapes_and_overflow_raise():
    q, k = _activations(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        estimate_layer_dof(q, k, 1e-2, 32)
    q, k = _activations(d=64, scale=12.0)  # |x|²/sqrt(d) ≈ 1150: exp overflows float64
    with pytest.raises(ValueError, match="gram_norm='trace'"):
        estimate_layer_dof(q, k, 1e-2, 32, "none")
    assert estimate_layer_dof(q, k, 1e-2, 32, "trace")[1] > 0
