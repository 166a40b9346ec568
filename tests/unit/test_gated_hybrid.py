"""The decay gate in hybrid attention (window + sinks exact, gated linear attention before): the chunked
form against the quadratic reference in value and gradient, at weak and strong decays, with sinks and
left padding, decoding token by token; a zero decay is the ungated hybrid exactly."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import hybrid_attention_chunked, hybrid_attention_naive
from dofla.attention.gate import ScalarGate
from dofla.models.student_attention import StudentAttention
from dofla.feature_maps import build_feature_map


def _inputs(t=41, decay=0.3, seed=0, b=2, h=3, d=8, m=12):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) * s for s in (1.5, 1.5, 1.0))
    log_q, log_k = (torch.randn(b, h, t, m, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    a = -decay * torch.rand(b, h, t, generator=g, dtype=torch.float64)
    return q, k, v, log_q, log_k, a


def _left_padded(t, pads=(0, 5)):
    valid = torch.ones(len(pads), t, dtype=torch.bool)
    for row, n in enumerate(pads):
        valid[row, :n] = False
    return valid


@pytest.mark.parametrize("decay", [0.05, 0.5, 5.0])
@pytest.mark.parametrize("window,sinks,chunk", [(1, 0, 1), (5, 0, 3), (8, 2, 8), (16, 4, 5), (40, 1, 64)])
def test_chunked_equals_the_reference(decay, window, sinks, chunk):
    q, k, v, lq, lk, a = _inputs(decay=decay)
    ref = hybrid_attention_naive(q, k, v, lq, lk, window, sinks=sinks, log_decay=a)
    out, state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk, sinks=sinks, log_decay=a)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert state.decay.shape == (2, 3, min(window, q.shape[2]))


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_left_padded_rows_equal_the_reference(chunk):
    q, k, v, lq, lk, a = _inputs()
    valid = _left_padded(q.shape[2])
    ref = hybrid_attention_naive(q, k, v, lq, lk, 6, sinks=2, key_valid=valid, log_decay=a)
    out, _ = hybrid_attention_chunked(q, k, v, lq, lk, 6, chunk, sinks=2, key_valid=valid, log_decay=a)
    torch.testing.assert_close(out[1, :, 5:], ref[1, :, 5:], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-9, atol=1e-10)
    # a pad decays nothing: the padded row is the unpadded row alone
    alone, _ = hybrid_attention_chunked(*(x[1:, :, 5:] for x in (q, k, v, lq, lk)), 6, chunk, sinks=2,
                                        log_decay=a[1:, :, 5:])
    torch.testing.assert_close(out[1:, :, 5:], alone, rtol=1e-9, atol=1e-10)


def test_gradients_equal_the_reference_and_reach_the_gate():
    leaves = [x.requires_grad_() for x in _inputs(t=23)]
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    weights = torch.randn(2, 3, 23, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q, k, v, lq, lk, a = leaves
    out, _ = hybrid_attention_chunked(q, k, v, lq, lk, 4, 5, sinks=1, log_decay=a)
    (out * weights).sum().backward()
    rq, rk, rv, rlq, rlk, ra = ref_leaves
    (hybrid_attention_naive(rq, rk, rv, rlq, rlk, 4, sinks=1, log_decay=ra) * weights).sum().backward()
    for mine, ref, name in zip(leaves, ref_leaves, ("q", "k", "v", "log_q", "log_k", "log_decay")):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-8, atol=1e-9, msg=name)
    assert a.grad.abs().max() > 1e-3


@pytest.mark.parametrize("prompt", [1, 9, 20])
def test_decoding_token_by_token_equals_the_full_forward(prompt):
    q, k, v, lq, lk, a = _inputs(t=30, decay=1.0)
    valid = _left_padded(30, (0, 3))
    full, _ = hybrid_attention_chunked(q, k, v, lq, lk, 7, 4, sinks=2, key_valid=valid, log_decay=a)
    part = lambda x, sl: x[:, :, sl] if x.dim() > 2 else x[:, sl]  # noqa: E731
    out, state = hybrid_attention_chunked(*(part(x, slice(0, prompt)) for x in (q, k, v, lq, lk)), 7, 4, sinks=2,
                                          key_valid=valid[:, :prompt], log_decay=a[:, :, :prompt])
    outs = [out]
    for t in range(prompt, 30):
        sl = slice(t, t + 1)
        o, state = hybrid_attention_chunked(*(part(x, sl) for x in (q, k, v, lq, lk)), 7, state=state, sinks=2,
                                            key_valid=valid[:, sl], log_decay=a[:, :, sl])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2)[0], full[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat(outs, 2)[1, :, 3:], full[1, :, 3:], rtol=1e-9, atol=1e-10)


def test_zero_decay_is_the_ungated_hybrid_and_a_decay_changes_only_rows_past_the_window():
    q, k, v, lq, lk, a = _inputs()
    ungated, _ = hybrid_attention_chunked(q, k, v, lq, lk, 6, 4, sinks=1)
    zero, _ = hybrid_attention_chunked(q, k, v, lq, lk, 6, 4, sinks=1, log_decay=torch.zeros_like(a))
    gated, _ = hybrid_attention_chunked(q, k, v, lq, lk, 6, 4, sinks=1, log_decay=a)
    torch.testing.assert_close(zero, ungated, rtol=1e-12, atol=1e-12)
    # rows 0..6 see only exact keys (window 6, sink 1): nothing there decays
    torch.testing.assert_close(gated[:, :, :7], ungated[:, :, :7], rtol=1e-12, atol=1e-12)
    assert (gated[:, :, 7:] - ungated[:, :, 7:]).abs().max() > 1e-2


def test_a_wrong_decay_shape_is_one_sentence():
    q, k, v, lq, lk, a = _inputs()
    with pytest.raises(ValueError, match=r"log_decay must be \(B, H, T\)"):
        hybrid_attention_chunked(q, k, v, lq, lk, 6, log_decay=a[:, :, :-1])


def test_a_gated_hybrid_layer_starts_as_the_ungated_one_and_opens_with_alpha():
    torch.manual_seed(0)
    h, d = 4, 8
    fm = build_feature_map("hedgehog", h, d, 8)
    gate = ScalarGate(h, d)
    gated = StudentAttention(h, 2, d, fm, chunk_size=8, window=5, sinks=2, gate=gate)
    plain = StudentAttention(h, 2, d, fm, chunk_size=8, window=5, sinks=2)
    q, k, v = torch.randn(2, h, 33, d), torch.randn(2, 2, 33, d), torch.randn(2, 2, 33, d)
    torch.testing.assert_close(gated(q, k, v)[0], plain(q, k, v)[0], rtol=0, atol=0)
    with torch.no_grad():
        gate.alpha.fill_(2.0)
    out, state = gated(q, k, v)
    assert state.decay is not None and (out - plain(q, k, v)[0]).abs().max() > 1e-3
