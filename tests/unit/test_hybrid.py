"""Hybrid attention (softmax window + linear past): chunked and decoding forms vs the reference."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import hybrid_attention_chunked, hybrid_attention_naive, softmax_attention
from dofla.feature_maps import build_feature_map


def _inputs(t=37, seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 3, 16
    q, k, v = (torch.randn(b, h, t, d, generator=g) * s for s in (scale, scale, 1.0))
    fm = build_feature_map("learned_prf", h, d, 24, seed=seed)
    return q, k, v, fm


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_matches_reference(window, chunk):
    q, k, v, fm = _inputs()
    lq, lk = fm.log_features(q), fm.log_features(k)
    ref = hybrid_attention_naive(q, k, v, lq, lk, window)
    out, state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk_size=chunk)
    assert _rel(out, ref) < 1e-5
    assert state.length == q.shape[2] and state.k.shape[2] == min(window, q.shape[2])


def test_gradients_match_reference():
    q, k, v, fm = _inputs(t=29)
    grads = []
    for fn in (hybrid_attention_naive, hybrid_attention_chunked):
        fm.zero_grad()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, fm.log_features(leaves[0]), fm.log_features(leaves[1]), 6)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([x.grad for x in leaves] + [p.grad.clone() for p in fm.parameters()])
    for a, b in zip(*grads):
        assert _rel(a, b) < 1e-5


def test_decoding_token_by_token_matches_and_memory_is_bounded():
    q, k, v, fm = _inputs(t=50)
    lq, lk = fm.log_features(q), fm.log_features(k)
    ref = hybrid_attention_naive(q, k, v, lq, lk, 8)
    out, state = hybrid_attention_chunked(q[:, :, :10], k[:, :, :10], v[:, :, :10], lq[:, :, :10], lk[:, :, :10], 8)
    outs, sizes = [out], []
    for t in range(10, 50):
        sl = slice(t, t + 1)
        o, state = hybrid_attention_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl], lq[:, :, sl], lk[:, :, sl], 8,
                                            state=state)
        outs.append(o)
        sizes.append(state.nbytes())
    assert _rel(torch.cat(outs, dim=2), ref) < 1e-5
    assert len(set(sizes)) == 1  # window full from the start: O(W + state), not O(T)


def test_window_covering_everything_is_softmax():
    q, k, v, fm = _inputs(t=20)
    out = hybrid_attention_naive(q, k, v, fm.log_features(q), fm.log_features(k), 20)
    assert torch.allclose(out, softmax_attention(q, k, v), atol=1e-6)
