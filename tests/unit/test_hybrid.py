"""Hybrid attention (softmax window + linear past): chunked and decoding forms vs the reference."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import hybrid_attention_chunked, hybrid_attention_naive, softmax_attention
from dofla.attention.sliding import sliding_window_naive
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


@pytest.mark.parametrize("window,sinks", [(4, 1), (5, 3), (8, 8), (3, 12)])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_sinks_chunked_matches_reference(window, sinks, chunk):
    q, k, v, fm = _inputs(t=31)
    lq, lk = fm.log_features(q), fm.log_features(k)
    ref = hybrid_attention_naive(q, k, v, lq, lk, window, sinks=sinks)
    out, state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk_size=chunk, sinks=sinks)
    assert _rel(out, ref) < 1e-5
    assert state.length == 31 and state.sink_k.shape[2] == min(sinks, 31 - window)
    # sinks change the result: they are exact, not approximated
    assert _rel(hybrid_attention_naive(q, k, v, lq, lk, window), ref) > 1e-3


def test_sinks_decoding_token_by_token_matches_and_memory_is_bounded():
    q, k, v, fm = _inputs(t=40, seed=2)
    lq, lk = fm.log_features(q), fm.log_features(k)
    window, sinks = 6, 3
    ref = hybrid_attention_naive(q, k, v, lq, lk, window, sinks=sinks)
    state, outs, sizes = None, [], []
    for t in range(40):
        sl = slice(t, t + 1)
        o, state = hybrid_attention_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl], lq[:, :, sl], lk[:, :, sl], window,
                                            state=state, sinks=sinks)
        outs.append(o)
        sizes.append(state.nbytes())
    assert _rel(torch.cat(outs, dim=2), ref) < 1e-5
    assert len(set(sizes[sinks + window:])) == 1  # bounded by sinks + W + the linear state


def test_sinks_gradients_match_reference():
    q, k, v, fm = _inputs(t=23, seed=3)
    grads = []
    for fn in (hybrid_attention_naive, hybrid_attention_chunked):
        fm.zero_grad()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, fm.log_features(leaves[0]), fm.log_features(leaves[1]), 5, sinks=2)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([x.grad for x in leaves] + [p.grad.clone() for p in fm.parameters()])
    for a, b in zip(*grads):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_left_padded_batch_matches_each_row_alone(chunk):
    q, k, v, fm = _inputs(t=19, seed=4)
    lq, lk = fm.log_features(q), fm.log_features(k)
    lengths, t, window = [19, 7], 19, 5
    valid = torch.arange(t)[None, :] >= torch.tensor([t - n for n in lengths])[:, None]
    out, state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk_size=chunk, key_valid=valid)
    ref = hybrid_attention_naive(q, k, v, lq, lk, window, key_valid=valid)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5
    assert state.valid.shape == (2, window)
    for b, n in enumerate(lengths):
        x = [a[b:b + 1, :, t - n:] for a in (q, k, v, lq, lk)]
        alone, _ = hybrid_attention_chunked(*x, window, chunk_size=chunk)
        assert _rel(out[b:b + 1, :, t - n:], alone) < 1e-5
        assert torch.equal(out[b, :, : t - n], torch.zeros_like(out[b, :, : t - n]))  # padding rows: 0


def test_decode_state_carries_key_validity():
    q, k, v, fm = _inputs(t=16, seed=5)
    lq, lk = fm.log_features(q), fm.log_features(k)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, :6] = False  # row 1 is left-padded by 6
    ref = hybrid_attention_naive(q, k, v, lq, lk, 4, key_valid=valid)
    out, state = hybrid_attention_chunked(*(a[:, :, :10] for a in (q, k, v, lq, lk)), 4, key_valid=valid[:, :10])
    outs = [out]
    for t in range(10, 16):
        o, state = hybrid_attention_chunked(*(a[:, :, t:t + 1] for a in (q, k, v, lq, lk)), 4, state=state)
        outs.append(o)
    assert _rel(torch.cat(outs, dim=2), ref) < 1e-5


def test_fp64_inputs_stay_fp64():
    q, k, v, fm = _inputs(t=12, seed=6)
    lq, lk = fm.log_features(q), fm.log_features(k)
    x = [a.double() for a in (q, k, v, lq, lk)]
    out, state = hybrid_attention_chunked(*x, 4, chunk_size=3)
    assert out.dtype == torch.float64 and state.linear.kv.dtype == torch.float64
    assert _rel(out, hybrid_attention_naive(*x, 4)) < 1e-12


def test_softcap_caps_the_exact_part_like_the_reference():
    q, k, v, fm = _inputs(t=21, seed=7, scale=3.0)
    lq, lk = fm.log_features(q), fm.log_features(k)
    ref = hybrid_attention_naive(q, k, v, lq, lk, 6, sinks=2, softcap=4.0)
    out, _ = hybrid_attention_chunked(q, k, v, lq, lk, 6, chunk_size=4, sinks=2, softcap=4.0)
    assert _rel(out, ref) < 1e-5
    assert _rel(hybrid_attention_naive(q, k, v, lq, lk, 6, sinks=2), ref) > 1e-3


def _left_padded(t=21, seed=8, pads=None):
    """Inputs for 4 rows and key_valid (4, T): row 0 unpadded, the others left-padded at random
    (the last row by all but one token) unless ``pads`` gives each row's pad count."""
    q, k, v, fm = _inputs(t=t, seed=seed)
    q, k, v = (torch.cat([a, a.flip(0)]) for a in (q, k, v))  # 4 rows
    if pads is None:
        middle = torch.randint(1, t - 1, (2,), generator=torch.Generator().manual_seed(seed)).tolist()
        pads = [0, *middle, t - 1]
    valid = torch.arange(t)[None, :] >= torch.tensor(pads)[:, None]
    return [q, k, v, fm.log_features(q).detach(), fm.log_features(k).detach()], valid


@pytest.mark.parametrize("window", [1, 8])
@pytest.mark.parametrize("sinks", [0, 1, 4])
@pytest.mark.parametrize("chunk", [1, 3, "window", 64])
def test_left_padded_sinks_chunked_matches_reference(window, sinks, chunk):
    x, valid = _left_padded()
    chunk = window if chunk == "window" else chunk
    ref = hybrid_attention_naive(*x, window, sinks=sinks, key_valid=valid)
    out, state = hybrid_attention_chunked(*x, window, chunk_size=chunk, sinks=sinks, key_valid=valid)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5
    held = state.sink_valid.sum(-1) + state.is_sink.sum(-1)  # each row holds its first sinks valid keys
    assert torch.equal(held, valid.sum(-1).clamp(max=sinks)) and state.length == 21


@pytest.mark.parametrize("window,sinks", [(1, 1), (1, 4), (8, 1), (8, 4), (3, 2)])
@pytest.mark.parametrize("form", ["naive", "chunked"])
def test_left_padded_row_with_sinks_equals_the_row_alone(window, sinks, form):
    x, valid = _left_padded(t=23, seed=9)
    if form == "naive":
        run = lambda *a, **kw: hybrid_attention_naive(*a, window, sinks=sinks, **kw)  # noqa: E731
    else:
        run = lambda *a, **kw: hybrid_attention_chunked(*a, window, chunk_size=3, sinks=sinks, **kw)[0]  # noqa: E731
    out = run(*x, key_valid=valid)
    for b in range(4):
        pad = int((~valid[b]).sum())
        alone = run(*(a[b:b + 1, :, pad:] for a in x))
        assert _rel(out[b:b + 1, :, pad:], alone) < 1e-5
        assert torch.equal(out[b, :, :pad], torch.zeros_like(out[b, :, :pad]))


def test_without_linear_part_hybrid_is_sliding_window_with_first_valid_sinks():
    """log_q → −∞ makes every K̂ vanish: what is left is softmax over the window and the sinks,
    which the sliding-window reference computes independently (first valid tokens as sinks)."""
    x, valid = _left_padded(t=19, seed=10)
    x = [a.double() for a in x]
    x[3] = torch.full_like(x[3], -1e4)
    ref = sliding_window_naive(x[0], x[1], x[2], 4, sinks=3, key_valid=valid).double()  # computed in fp32
    assert _rel(hybrid_attention_naive(*x, 4, sinks=3, key_valid=valid), ref) < 1e-6
    out, _ = hybrid_attention_chunked(*x, 4, chunk_size=5, sinks=3, key_valid=valid)
    assert _rel(out, ref) < 1e-6


@pytest.mark.parametrize("prompt", [1, 10])
def test_left_padded_sinks_decoding_token_by_token_equals_full_forward(prompt):
    x, valid = _left_padded(t=24, seed=11, pads=[0, 3, 12, 23])  # row 3's sinks arrive while decoding
    window, sinks = 4, 3
    full, _ = hybrid_attention_chunked(*x, window, chunk_size=5, sinks=sinks, key_valid=valid)
    out, state = hybrid_attention_chunked(*(a[:, :, :prompt] for a in x), window, sinks=sinks,
                                          key_valid=valid[:, :prompt])
    outs = [out]
    for t in range(prompt, 24):
        o, state = hybrid_attention_chunked(*(a[:, :, t:t + 1] for a in x), window, state=state, sinks=sinks,
                                            key_valid=valid[:, t:t + 1])
        outs.append(o)
    assert _rel(torch.cat(outs, dim=2), full) < 1e-5
    assert state.sink_valid.sum(-1).tolist() == [3, 3, 3, 0]  # row 3 has one valid key, still in the window


def test_beam_reordering_the_state_carries_each_rows_sinks():
    x, valid = _left_padded(t=20, seed=12, pads=[0, 2, 7, 9])
    order = torch.tensor([2, 0, 3, 1])
    full, _ = hybrid_attention_chunked(*(a[order] for a in x), 3, chunk_size=4, sinks=2, key_valid=valid[order])
    _, state = hybrid_attention_chunked(*(a[:, :, :12] for a in x), 3, chunk_size=4, sinks=2, key_valid=valid[:, :12])
    out, _ = hybrid_attention_chunked(*(a[order, :, 12:] for a in x), 3, state=state.index_select(order), sinks=2)
    assert _rel(out, full[:, :, 12:]) < 1e-5


def test_left_padded_sinks_gradients_are_finite_and_match_reference():
    x, valid = _left_padded(t=17, seed=13)
    fm = _inputs(t=17, seed=13)[3]
    grads = []
    for fn in (hybrid_attention_naive, hybrid_attention_chunked):
        fm.zero_grad()
        leaves = [a.clone().requires_grad_() for a in x[:3]]
        chunk = {} if fn is hybrid_attention_naive else {"chunk_size": 3}
        out = fn(*leaves, fm.log_features(leaves[0]), fm.log_features(leaves[1]), 4, sinks=2, key_valid=valid, **chunk)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([a.grad for a in leaves] + [p.grad.clone() for p in fm.parameters()])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.isfinite(b).all() and _rel(a, b) < 1e-5


@pytest.mark.parametrize("window, sinks, chunk", [(5, 0, 3), (8, 2, 8), (4, 3, 1)])
def test_grouped_keys_are_held_once_per_kv_head(window, sinks, chunk):
    """Six query heads over two KV heads (k, v repeated per query head, as the student passes them): group=3 gives
    the reference's outputs, prefill and token by token, with a state holding the two KV heads' keys and values."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 31, 16, generator=g)
    k, v = (torch.randn(2, 2, 31, 16, generator=g).repeat_interleave(3, dim=1) for _ in range(2))
    fm = build_feature_map("learned_prf", 6, 16, 24, seed=1)
    lq, lk = fm.log_features(q), fm.log_features(k)
    decay = -torch.rand(2, 6, 31, generator=g) * 0.3
    ref = hybrid_attention_naive(q, k, v, lq, lk, window, sinks=sinks, log_decay=decay)
    out, state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk, sinks=sinks, log_decay=decay, group=3)
    assert _rel(out, ref) < 1e-5
    every, every_state = hybrid_attention_chunked(q, k, v, lq, lk, window, chunk, sinks=sinks, log_decay=decay)
    assert state.k.shape[1] == state.v.shape[1] == state.sink_k.shape[1] == 2 and state.log_k.shape[1] == 6
    assert every_state.k.shape[1] == 6 and state.nbytes() < every_state.nbytes()
    parts, held = [out[:, :, :12]], hybrid_attention_chunked(*(x[:, :, :12] for x in (q, k, v, lq, lk)), window, chunk,
                                                               sinks=sinks, log_decay=decay[:, :, :12], group=3)[1]
    for t in range(12, 31):
        sl = slice(t, t + 1)
        o, held = hybrid_attention_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl], lq[:, :, sl], lk[:, :, sl], window,
                                           state=held, sinks=sinks, log_decay=decay[:, :, sl], group=3)
        parts.append(o)
    assert _rel(torch.cat(parts, 2), ref) < 1e-5 and _rel(every, ref) < 1e-5


def test_a_group_must_divide_the_heads():
    q, k, v, fm = _inputs(t=5)
    with pytest.raises(ValueError, match="must divide the 3 heads"):
        hybrid_attention_chunked(q, k, v, fm.log_features(q), fm.log_features(k), 4, group=2)
