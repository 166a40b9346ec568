"""A gated-delta layer: pure and as the hybrid's older part, chunked and token by token against the plain
references (outputs and gradients, fp64, odd sizes, sinks, padding); a context inside the window is the
exact softmax; the gain calibration is the least-squares fit."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import softmax_attention
from dofla.attention.delta import delta_rule_naive, unit_features
from dofla.attention.delta_gates import DeltaFeatureMap, DeltaGates
from dofla.attention.delta_hybrid import hybrid_delta_chunked, hybrid_delta_naive
from dofla.feature_maps import build_feature_map

B, H, D, M = 2, 3, 6, 5


def tensors(t=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, t, D, generator=g, dtype=torch.float64) for _ in range(3))
    log_q, log_k = (torch.randn(B, H, t, M, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, log_q, log_k


def open_gates(seed=1) -> DeltaGates:
    """Gates with data-dependent, visibly non-trivial values (not the near-additive start)."""
    gates = DeltaGates(H, D).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gates.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return gates


# (window, sinks, chunk): chunk None = the window
CASES = [(4, 0, None), (4, 2, 3), (7, 1, 5), (7, 0, 16), (40, 0, None)]


@pytest.mark.parametrize("window,sinks,chunk", CASES)
def test_hybrid_delta_chunked_and_decoded_equal_the_reference(window, sinks, chunk):
    q, k, v, lq, lk = tensors()
    gates = open_gates()
    ref = hybrid_delta_naive(q, k, v, lq, lk, window, gates, sinks=sinks)
    out, _ = hybrid_delta_chunked(q, k, v, lq, lk, window, gates, chunk, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    first, state = hybrid_delta_chunked(*(x[:, :, :9] for x in (q, k, v, lq, lk)), window, gates, chunk, sinks=sinks)
    parts = [first]
    for t in range(9, q.shape[2]):  # decoding: one token against the carried state
        out, state = hybrid_delta_chunked(*(x[:, :, t:t + 1] for x in (q, k, v, lq, lk)), window, gates, chunk, state,
                                          sinks=sinks)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), ref, rtol=1e-10, atol=1e-11)
    assert state.delta is not None and state.linear.kv.shape[-1] == 0  # the linear part keeps only the mass


def test_hybrid_delta_gradients_equal_the_reference():
    inputs = [x.requires_grad_() for x in tensors(t=17)]
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    gates, ref_gates = open_gates(), open_gates()
    w = torch.randn(B, H, 17, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out, _ = hybrid_delta_chunked(*inputs, 4, gates, 3, sinks=1)
    (out * w).sum().backward()
    (hybrid_delta_naive(*ref_inputs, 4, ref_gates, sinks=1) * w).sum().backward()
    for mine, theirs in zip(inputs + list(gates.parameters()), ref_inputs + list(ref_gates.parameters())):
        assert theirs.grad.abs().max() > 0
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-10)


def test_a_context_inside_the_window_is_exact_softmax():
    q, k, v, lq, lk = tensors(t=11)
    out, _ = hybrid_delta_chunked(q, k, v, lq, lk, 11, open_gates(), sinks=2)
    torch.testing.assert_close(out, softmax_attention(q, k, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [0, 5])
def test_a_left_padded_row_equals_the_row_alone(window):
    q, k, v, lq, lk = tensors(t=15)
    layer = DeltaFeatureMap(build_feature_map("hedgehog", H, D, M).double(), open_gates())
    pads = 4
    padded = [torch.cat([torch.randn_like(x[:, :, :pads]), x], 2) for x in (q, k, v)]
    valid = torch.ones(B, 15 + pads, dtype=torch.bool)
    valid[:, :pads] = False
    out, _ = layer.attend(*padded, key_valid=valid, window=window, sinks=1 if window else 0, chunk_size=4)
    alone, _ = layer.attend(q, k, v, window=window, sinks=1 if window else 0, chunk_size=4)
    torch.testing.assert_close(out[:, :, pads:], alone, rtol=1e-10, atol=1e-11)


def test_the_pure_layer_is_the_delta_rule_through_its_gates():
    q, k, v, _, _ = tensors()
    layer = DeltaFeatureMap(build_feature_map("hedgehog", H, D, M).double(), open_gates())
    out, state = layer.attend(q, k, v, chunk_size=8)
    log_alpha, beta = layer.gates(v)
    read, ref_state = delta_rule_naive(unit_features(layer.log_features(q)), unit_features(layer.log_features(k)), v,
                                       log_alpha, beta)
    torch.testing.assert_close(out, layer.gates.output(read, v), rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(state.S, ref_state.S, rtol=1e-10, atol=1e-11)
    assert ((beta > 0) & (beta < 1)).all() and (log_alpha < 0).all()


def test_fresh_gates_start_near_additive_and_the_output_gate_at_one():
    gates = DeltaGates(H, D)
    v = torch.randn(B, H, 7, D)
    log_alpha, beta = gates(v)
    torch.testing.assert_close(beta, torch.full_like(beta, 0.1))
    torch.testing.assert_close(log_alpha, torch.full_like(log_alpha, -1e-3))
    o = torch.randn(B, H, 7, D)
    torch.testing.assert_close(gates.output(o, v), o / o.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


@pytest.mark.parametrize("window", [0, 4])
def test_calibration_is_the_least_squares_gain(window):
    q, k, v, _, _ = tensors(t=21)
    y = softmax_attention(q, k, v)
    layer = DeltaFeatureMap(build_feature_map("hedgehog", H, D, M).double(), open_gates())
    layer.calibrate_(q, k, v, y, window=window, chunk_size=4)
    assert bool(layer.calibrated)
    fitted = layer.attend(q, k, v, window=window, chunk_size=4)[0]
    best = (fitted - y).pow(2).sum((0, 2))  # per head and channel
    gain = layer.gates.norm_weight
    for factor in (0.9, 1.1):
        with torch.no_grad():
            gain.mul_(factor)
        worse = (layer.attend(q, k, v, window=window, chunk_size=4)[0] - y).pow(2).sum((0, 2))
        with torch.no_grad():
            gain.div_(factor)
        assert (worse >= best - 1e-12).all()


def test_the_delta_hybrid_holds_each_kv_heads_keys_once():
    """Three query heads over one KV head: group=3 decodes the reference's outputs from a window holding one copy."""
    q, _, _, lq, lk = tensors()
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randn(B, 1, q.shape[2], D, generator=g, dtype=torch.float64).repeat_interleave(H, 1) for _ in range(2))
    gates = open_gates()
    ref = hybrid_delta_naive(q, k, v, lq, lk, 4, gates, sinks=2)
    first, state = hybrid_delta_chunked(*(x[:, :, :9] for x in (q, k, v, lq, lk)), 4, gates, 3, sinks=2, group=H)
    parts = [first]
    for t in range(9, q.shape[2]):
        out, state = hybrid_delta_chunked(*(x[:, :, t:t + 1] for x in (q, k, v, lq, lk)), 4, gates, 3, state, sinks=2,
                                          group=H)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), ref, rtol=1e-10, atol=1e-11)
    assert state.k.shape[1] == state.sink_k.shape[1] == 1 and state.log_k.shape[1] == H
