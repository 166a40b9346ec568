"""Attention kernels: the naive, chunked and recurrent linear attentions agree (outputs and
gradients), prefill + decode equals one pass, realistic PRF norms stay finite, and the softmax
reference matches PyTorch's SDPA (incl. GQA).

Errors are ||a − b|| / ||b|| with b a float64 naive reference; the fp32 requirement is < 1e-5.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dofla.attention import (
    LinearState,
    linear_attention_chunked,
    linear_attention_naive,
    linear_attention_recurrent,
    softmax_attention,
)
from dofla.feature_maps import build_feature_map

B, H, D = 2, 3, 16
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qkv(t: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, t, D, generator=g, dtype=dtype) for _ in range(3)]


def _log_features(m: int, t: int, seed: int = 0):
    fm = build_feature_map("learned_prf", H, D, m, seed=seed)
    q, k, v = _qkv(t, seed)
    with torch.no_grad():
        return fm.log_features(q), fm.log_features(k), v


@pytest.mark.parametrize("t", [1, 7, 129])
@pytest.mark.parametrize("m", [24, 5])
def test_forward_agreement(t, m):
    log_q, log_k, v = _log_features(m, t)
    ref = linear_attention_naive(log_q.double(), log_k.double(), v.double())
    assert rel(linear_attention_naive(log_q, log_k, v), ref) < TOL
    for chunk in (1, 4, 64, 200):
        out, state = linear_attention_chunked(log_q, log_k, v, chunk_size=chunk)
        assert out.shape == v.shape and out.dtype == v.dtype and state.length == t
        assert rel(out, ref) < TOL, chunk
    out, state = linear_attention_recurrent(log_q, log_k, v)
    assert rel(out, ref) < TOL and state.length == t


def _grads(fn, fm, q, k, v, w):
    """Gradients of <fn(log φ(q), log φ(k), v), w> w.r.t. q, k, v and the feature-map params."""
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(fm.log_features(leaves[0]), fm.log_features(leaves[1]), leaves[2])
    params = list(fm.parameters())
    return torch.autograd.grad((out * w).sum(), leaves + params)


@pytest.mark.parametrize("t", [7, 129])
@pytest.mark.parametrize("m", [24, 5])
def test_gradient_agreement(t, m):
    fm = build_feature_map("learned_prf", H, D, m, seed=1)
    with torch.no_grad():  # move off the init so α's gradient is not a trivial pattern
        fm.alpha_param.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    q, k, v = _qkv(t, seed=3)
    w = torch.randn(B, H, t, D, generator=torch.Generator().manual_seed(4))
    fm64 = copy.deepcopy(fm).double()
    ref = _grads(linear_attention_naive, fm64, q.double(), k.double(), v.double(), w.double())
    forms = {
        "naive32": linear_attention_naive,
        "recurrent": lambda a, b, c: linear_attention_recurrent(a, b, c)[0],
        **{f"chunk{c}": (lambda a, b, x, c=c: linear_attention_chunked(a, b, x, chunk_size=c)[0])
           for c in (1, 4, 64, 200)},
    }
    names = ["q", "k", "v", "z", "alpha"]
    for form, fn in forms.items():
        for name, got, want in zip(names, _grads(fn, fm, q, k, v, w), ref):
            err = rel(got, want)
            assert err < TOL, (form, name, err)


@pytest.mark.parametrize("t1,t2", [(1, 5), (37, 11), (64, 1)])
def test_prefill_then_decode_matches_one_pass(t1, t2):
    log_q, log_k, v = _log_features(24, t1 + t2, seed=5)
    full, full_state = linear_attention_chunked(log_q, log_k, v, chunk_size=16)
    pre, state = linear_attention_chunked(log_q[:, :, :t1], log_k[:, :, :t1], v[:, :, :t1], chunk_size=16)
    size = state.nbytes()
    outs = [pre]
    for i in range(t1, t1 + t2):  # decode one token at a time, as generation does
        out, state = linear_attention_recurrent(log_q[:, :, i:i + 1], log_k[:, :, i:i + 1], v[:, :, i:i + 1], state)
        outs.append(out)
    assert rel(torch.cat(outs, dim=2), full) < TOL
    assert state.length == t1 + t2 and state.nbytes() == size  # fixed-size state
    assert state.kv.shape == (B, H, 24, D)
    # Same final state (offsets are maxima over the same keys, so kv is directly comparable).
    assert torch.equal(state.offset, full_state.offset) and rel(state.kv, full_state.kv) < TOL
    # Continuing with the chunked form from a state works too.
    pre2, st = linear_attention_chunked(log_q[:, :, :t1], log_k[:, :, :t1], v[:, :, :t1], 5)
    cont, _ = linear_attention_chunked(log_q[:, :, t1:], log_k[:, :, t1:], v[:, :, t1:], 7, state=st)
    assert rel(torch.cat([pre2, cont], dim=2), full) < TOL


def test_state_helpers():
    log_q, log_k, v = _log_features(8, 10)
    _, state = linear_attention_chunked(log_q, log_k, v)
    picked = state.index_select(torch.tensor([1, 1]))
    assert torch.equal(picked.kv[0], state.kv[1]) and picked.length == state.length
    empty = LinearState.zeros(B, H, 8, D)
    out, _ = linear_attention_chunked(log_q, log_k, v, state=empty)
    assert rel(out, linear_attention_chunked(log_q, log_k, v)[0]) == 0
    assert linear_attention_chunked(log_q[:, :, :0], log_k[:, :, :0], v[:, :, :0])[0].shape == (B, H, 0, D)


def test_half_precision_values_are_computed_in_fp32():
    log_q, log_k, v = _log_features(24, 33)
    out, state = linear_attention_chunked(log_q, log_k, v.bfloat16(), chunk_size=8)
    assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
    assert rel(out, linear_attention_naive(log_q, log_k, v.bfloat16().float())) < 1e-2


def _realistic(t: int, d: int, seed: int) -> torch.Tensor:
    """(1, 1, T, d) vectors with |x|²/sqrt(d) uniform in [9, 140], as measured on SmolLM2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, t, d, generator=g)
    sq = torch.empty(1, 1, t, 1).uniform_(9, 140, generator=g) * math.sqrt(d)
    return x / x.norm(dim=-1, keepdim=True) * sq.sqrt()


def test_prf_long_sequence_realistic_norms_is_finite():
    d, t = 64, 32768
    fm = build_feature_map("performer", 1, d, 64)
    with torch.no_grad():
        log_q, log_k = fm.log_features(_realistic(t, d, 0)), fm.log_features(_realistic(t, d, 1))
        v = torch.randn(1, 1, t, d, generator=torch.Generator().manual_seed(2))
        out, state = linear_attention_chunked(log_q, log_k, v, chunk_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(state.kv).all()
    # Every output is a convex combination of values: no row collapsed to 0 by underflow.
    assert (out.abs().amax(-1) > 0).all() and out.abs().max() <= v.abs().max() * (1 + 1e-4)
    n = 256  # and the first rows still match the exact log-space reference
    ref = linear_attention_naive(log_q[:, :, :n].double(), log_k[:, :, :n].double(), v[:, :, :n].double())
    assert rel(out[:, :, :n], ref) < TOL


def test_gradients_agree_at_realistic_norms():
    """Training runs the chunked form on real q/k norms: its gradients must stay exact there."""
    d, t = 64, 256
    fm = build_feature_map("learned_prf", 1, d, 64)
    q, k = _realistic(t, d, 3), _realistic(t, d, 4)
    g = torch.Generator().manual_seed(5)
    v, w = torch.randn(2, 1, 1, t, d, generator=g)
    ref = _grads(linear_attention_naive, copy.deepcopy(fm).double(), q.double(), k.double(), v.double(), w.double())
    got = _grads(lambda a, b, c: linear_attention_chunked(a, b, c, chunk_size=64)[0], fm, q, k, v, w)
    for name, a, b in zip(["q", "k", "v", "z", "alpha"], got, ref):
        assert torch.isfinite(a).all() and rel(a, b) < TOL, (name, rel(a, b))


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_matches_sdpa(causal):
    q, k, v = _qkv(19, seed=6)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(softmax_attention(q, k, v, causal=causal), ref)


def test_softmax_gqa_repeats_each_kv_head_for_its_group():
    q, _, _ = _qkv(11, seed=7)
    q = torch.cat([q, q], dim=1)  # 6 query heads
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(2, B, 2, 11, D, generator=g)  # 2 kv heads -> groups of 3
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    out = softmax_attention(q, k, v)
    torch.testing.assert_close(out, expected)
    # Query head 4 belongs to group 1: it must equal single-head attention against kv head 1.
    torch.testing.assert_close(out[:, 4:5], softmax_attention(q[:, 4:5], k[:, 1:2], v[:, 1:2]))
    with pytest.raises(ValueError, match="divide"):
        softmax_attention(q, k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1))


def _left_padded(lengths, t, seed=9, m=12):
    """log_q, log_k, v (B, H, T, ·) with random data everywhere and key_valid (B, T): row b holds
    lengths[b] real tokens at the end (left padding)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    log_q, log_k = (torch.randn(b, H, t, m, generator=g) for _ in range(2))
    v = torch.randn(b, H, t, D, generator=g)
    valid = torch.arange(t)[None, :] >= torch.tensor([t - n for n in lengths])[:, None]
    return log_q, log_k, v, valid


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_left_padded_batch_matches_each_row_alone(chunk):
    lengths, t = [13, 6, 1], 13
    log_q, log_k, v, valid = _left_padded(lengths, t)
    out, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=chunk, key_valid=valid)
    rec, _ = linear_attention_recurrent(log_q, log_k, v, key_valid=valid)
    ref = linear_attention_naive(log_q, log_k, v, key_valid=valid)
    for b, n in enumerate(lengths):
        alone, _ = linear_attention_chunked(log_q[b:b + 1, :, t - n:], log_k[b:b + 1, :, t - n:],
                                            v[b:b + 1, :, t - n:], chunk_size=chunk)
        for got in (out, rec, ref):
            assert rel(got[b:b + 1, :, t - n:], alone) < TOL
        # padding rows see no valid key: zeros, not NaN
        for got in (out, rec, ref):
            assert torch.equal(got[b, :, : t - n], torch.zeros_like(got[b, :, : t - n]))


def test_padding_then_decoding_matches_the_unpadded_sequence():
    lengths, t = [9, 4], 9
    log_q, log_k, v, _ = _left_padded(lengths, t + 3, seed=10)
    # row b: padding, then lengths[b] prompt tokens ending at t, then three decoded tokens
    valid = torch.arange(t + 3)[None, :] >= torch.tensor([t - n for n in lengths])[:, None]
    pre, state = linear_attention_chunked(log_q[:, :, :t], log_k[:, :, :t], v[:, :, :t], 4, key_valid=valid[:, :t])
    outs = [pre]
    for i in range(t, t + 3):
        o, state = linear_attention_recurrent(log_q[:, :, i:i + 1], log_k[:, :, i:i + 1], v[:, :, i:i + 1], state,
                                              key_valid=valid[:, i:i + 1])
        outs.append(o)
    out = torch.cat(outs, dim=2)
    for b, n in enumerate(lengths):
        s = t - n
        alone = linear_attention_naive(log_q[b:b + 1, :, s:], log_k[b:b + 1, :, s:], v[b:b + 1, :, s:])
        assert rel(out[b:b + 1, :, s:], alone) < TOL


def test_minus_inf_log_features_contribute_nothing():
    log_q, log_k, v = _log_features(12, 20, seed=11)
    log_k = log_k.clone()
    log_k[:, :, 3] = float("-inf")  # a whole key: the same as padding it
    log_k[:, :, 7:9, :5] = float("-inf")  # some features of two keys
    valid = torch.ones(B, 20, dtype=torch.bool)
    valid[:, 3] = False
    finite_k = log_k.masked_fill(~valid[:, None, :, None], 0.0)
    ref = linear_attention_naive(log_q.double(), finite_k.double(), v.double(), key_valid=valid)
    for chunk in (1, 8):
        out, state = linear_attention_chunked(log_q, log_k, v, chunk_size=chunk)
        assert torch.isfinite(out).all() and torch.isfinite(state.kv).all() and rel(out, ref) < TOL
    assert rel(linear_attention_recurrent(log_q, log_k, v)[0], ref) < TOL
    with pytest.raises(ValueError, match="key_valid"):
        linear_attention_chunked(log_q, log_k, v, key_valid=valid[:, :5])
