"""The causal losses without (L, L) matrices (dofla.train.causal_losses) against their plain forms:
same value, same gradients, at lengths of several stabiliser blocks (128 keys each)."""
from __future__ import annotations

import pytest
import torch

from dofla.feature_maps import build_feature_map
from dofla.train.losses import LOSSES, l2_dense, output_dense, softmax_dense


def _qkv(t, scale=1.0, d=16, h=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, t, d, generator=g) * s for s in (scale, scale, 1.0))


def _value_and_grads(fm, fn):
    fm.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in fm.parameters()]


def _assert_same(fm, fast, plain, rtol=1e-4):
    (a, ga), (b, gb) = _value_and_grads(fm, fast), _value_and_grads(fm, plain)
    assert a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-7)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-6 * y.abs().max().item())


@pytest.mark.parametrize("scale", ["row_max", "none", "rows"])
@pytest.mark.parametrize("t, softcap", [(40, None), (300, None), (300, 2.0)])
def test_l2_on_pieces_matches_the_plain_form(scale, t, softcap):
    q, k, _ = _qkv(t)
    fm = build_feature_map("learned_prf", 2, 16, 24)

    def run(fn):
        return lambda: fn(fm.log_features(q), fm.log_features(k), q, k)

    fast = run(lambda lq, lk, q_, k_: LOSSES.get("l2")(lq, lk, q_, k_, scale=scale, softcap=softcap))
    plain = run(lambda lq, lk, q_, k_: l2_dense(lq, lk, q_, k_, True, 0, scale, softcap=softcap))
    _assert_same(fm, fast, plain)


def test_l2_on_pieces_keeps_an_overestimating_student_finite():
    """A student far above the teacher saturates (continued linearly above e^30 of the row's top)
    in both forms alike: a huge, finite loss with finite gradients, the same in both."""
    q, k, _ = _qkv(260, scale=3.0)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    with torch.no_grad():
        for p in fm.parameters():
            p.mul_(1.5)
    fast = lambda: LOSSES.get("l2")(fm.log_features(q), fm.log_features(k), q, k)  # noqa: E731
    plain = lambda: l2_dense(fm.log_features(q), fm.log_features(k), q, k, True, 0, "row_max")  # noqa: E731
    value, grads = _value_and_grads(fm, fast)
    assert value > 1e15 and torch.isfinite(value) and all(torch.isfinite(g).all() for g in grads)
    _assert_same(fm, fast, plain)


HYBRIDS = [(16, 0, None), (16, 3, None), (16, 3, 2.0), (40, 130, None), (200, 130, None)]
# sinks beyond a block; then window + sinks cover every row (nothing approximated, zero gradients)


@pytest.mark.parametrize("window, sinks, softcap", HYBRIDS)
@pytest.mark.parametrize("loss, options", [("softmax", {}), ("l2", {"scale": "row_max"}), ("l2", {"scale": "none"}),
                                           ("l2", {"scale": "rows"})])
def test_hybrid_losses_on_pieces_and_band_match_the_plain_forms(loss, options, window, sinks, softcap):
    """A hybrid layer's losses: K̂'s keys on the stabiliser's pieces, the exact window and sinks on a
    band of row blocks; value and gradients as the (L, L) forms at 300 tokens (3 blocks)."""
    q, k, _ = _qkv(300, scale=1.2)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    dense = softmax_dense if loss == "softmax" else (
        lambda lq, lk, q_, k_, *a, **kw: l2_dense(lq, lk, q_, k_, a[0], a[1], options["scale"], *a[2:], **kw))
    fast = lambda: LOSSES.get(loss)(fm.log_features(q), fm.log_features(k), q, k, window=window,  # noqa: E731
                                    sinks=sinks, softcap=softcap, **options)
    plain = lambda: dense(fm.log_features(q), fm.log_features(k), q, k, True, window, sinks,  # noqa: E731
                          softcap=softcap)
    _assert_same(fm, fast, plain)


@pytest.mark.parametrize("window, sinks, softcap", [(0, 0, None), (0, 0, 2.0), (16, 0, None), (16, 2, None),
                                                    (16, 2, 2.0)])
def test_output_loss_from_chunked_kernels_matches_the_attention_rows(window, sinks, softcap):
    q, k, v = _qkv(300, scale=1.2)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    fast = lambda: LOSSES.get("output")(fm.log_features(q), fm.log_features(k), q, k,  # noqa: E731
                                        window=window, sinks=sinks, v=v, softcap=softcap)
    plain = lambda: output_dense(fm.log_features(q), fm.log_features(k), q, k, v, True, window,  # noqa: E731
                                 sinks, softcap)
    _assert_same(fm, fast, plain)


def test_pieces_hold_less_memory_than_the_plain_forms():
    """What the backward keeps: the pieces' l2 and the chunked output loss hold a fraction of the
    plain forms' peak (a PeakTracker trace of forward + backward, the preflight's own meter)."""
    from dofla.train.capacity import traced_peak

    q, k, v = _qkv(512, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 16)

    def peak(fn):
        return traced_peak(lambda: fn(fm.log_features(q), fm.log_features(k)).backward())

    l2_fast = peak(lambda lq, lk: LOSSES.get("l2")(lq, lk, q, k))
    l2_plain = peak(lambda lq, lk: l2_dense(lq, lk, q, k, True, 0, "row_max"))
    out_fast = peak(lambda lq, lk: LOSSES.get("output")(lq, lk, q, k, v=v))
    out_plain = peak(lambda lq, lk: output_dense(lq, lk, q, k, v, True, 0))
    assert l2_fast < 0.6 * l2_plain
    assert out_fast < 0.2 * out_plain


def test_hybrid_softmax_on_pieces_holds_less_memory_than_the_plain_form():
    from dofla.train.capacity import traced_peak

    q, k, _ = _qkv(512, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 16)

    def peak(fn):
        return traced_peak(lambda: fn(fm.log_features(q), fm.log_features(k)).backward())

    fast = peak(lambda lq, lk: LOSSES.get("softmax")(lq, lk, q, k, window=64, sinks=4))
    plain = peak(lambda lq, lk: softmax_dense(lq, lk, q, k, True, 64, 4))
    assert fast < 0.6 * plain
