"""Sliding-window + sinks attention: chunked == naive, decode == chunked, bounded state, padding."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import softmax_attention
from dofla.attention.sliding import sliding_window_chunked, sliding_window_naive


def _qkv(b=2, h=3, t=23, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [2 * torch.randn(b, h, t, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize(
    "t, window, sinks, chunk",
    [(3, 5, 4, 2), (7, 9, 2, 3), (37, 5, 3, 4), (37, 1, 4, 16), (41, 6, 0, 5), (29, 4, 7, 29)],
)
def test_chunked_equals_naive(t, window, sinks, chunk):
    q, k, v = _qkv(t=t)
    ref = sliding_window_naive(q, k, v, window, sinks)
    out, state = sliding_window_chunked(q, k, v, window, sinks, chunk_size=chunk)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert state.length == t


def test_token_by_token_decode_equals_chunked():
    q, k, v = _qkv(t=30)
    full, _ = sliding_window_chunked(q, k, v, window=6, sinks=3, chunk_size=7)
    prefix, state = sliding_window_chunked(q[:, :, :11], k[:, :, :11], v[:, :, :11], 6, 3, chunk_size=4)
    steps = [prefix]
    for i in range(11, 30):
        out, state = sliding_window_chunked(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 6, 3, state=state)
        steps.append(out)
    assert torch.allclose(torch.cat(steps, dim=2), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, window, sinks, chunk", [(23, 5, 3, 4), (9, 12, 2, 1), (31, 1, 0, 8)])
def test_grouped_queries_read_their_kv_head_held_once(t, window, sinks, chunk):
    """Six query heads over two KV heads: the same outputs as keys copied out to every query head (the
    naive reference does that), with the window's state holding the two KV heads only."""
    q, (k, v) = _qkv(h=6, t=t)[0], _qkv(h=2, t=t, seed=1)[1:]
    copied = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    out, state = sliding_window_chunked(q, k, v, window, sinks, chunk_size=chunk)
    ref, ref_state = sliding_window_chunked(q, *copied, window, sinks, chunk_size=chunk)
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6)
    assert torch.allclose(out, sliding_window_naive(q, k, v, window, sinks), atol=1e-5, rtol=1e-5)
    assert state.k.shape[1] == state.sink_k.shape[1] == 2 and ref_state.k.shape[1] == 6
    assert state.nbytes() <= ref_state.nbytes() / 2


def test_grouped_decode_equals_chunked():
    q, (k, v) = _qkv(h=4, t=20)[0], _qkv(h=2, t=20, seed=2)[1:]
    full, _ = sliding_window_chunked(q, k, v, window=5, sinks=2, chunk_size=3)
    steps, state = [], None
    for i in range(20):
        out, state = sliding_window_chunked(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 5, 2, state=state)
        steps.append(out)
    assert torch.allclose(torch.cat(steps, dim=2), full, atol=1e-5, rtol=1e-5)


def test_query_heads_must_be_a_multiple_of_kv_heads():
    q, (k, v) = _qkv(h=5)[0], _qkv(h=2)[1:]
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        sliding_window_chunked(q, k, v, window=4)


def test_state_size_is_constant_in_length():
    q, k, v = _qkv(b=1, t=60)
    state, sizes = None, []
    for i in range(60):
        _, state = sliding_window_chunked(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 8, 4, state=state)
        sizes.append(state.nbytes())
    assert state.k.shape[2] == 7 and state.sink_k.shape[2] == 4
    assert sizes[20] == sizes[40] == sizes[59]


def test_no_sinks_is_plain_sliding_window():
    q, k, v = _qkv(t=19)
    out, _ = sliding_window_chunked(q, k, v, window=4, sinks=0, chunk_size=5)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(19)[:, None], torch.arange(19)[None, :]
    scores = scores.masked_fill((j > i) | (j <= i - 4), float("-inf"))
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)


def test_window_covering_everything_is_causal_softmax():
    q, k, v = _qkv(t=17)
    out, _ = sliding_window_chunked(q, k, v, window=17, sinks=4, chunk_size=6)
    assert torch.allclose(out, softmax_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_sinks_see_the_first_tokens_forever():
    q, k, v = _qkv(b=1, t=40)
    q = q / 8  # moderate scores: no sink weight underflows to exactly 0
    with_sinks, _ = sliding_window_chunked(q, k, v, window=3, sinks=2, chunk_size=8)
    changed = v.clone()
    changed[:, :, 0] += 5.0  # a sink: every later output moves
    moved, _ = sliding_window_chunked(q, k, changed, window=3, sinks=2, chunk_size=8)
    assert (moved[:, :, 30:] - with_sinks[:, :, 30:]).abs().amin() > 0
    changed = v.clone()
    changed[:, :, 5] += 5.0  # neither sink nor in the window of position ≥ 8
    moved, _ = sliding_window_chunked(q, k, changed, window=3, sinks=2, chunk_size=8)
    assert torch.equal(moved[:, :, 8:], with_sinks[:, :, 8:])


@pytest.mark.parametrize("chunk", [3, 64])
def test_left_padding_equals_the_row_alone(chunk):
    q, k, v = _qkv(b=1, t=21)
    pad = 6
    alone, _ = sliding_window_chunked(q, k, v, window=5, sinks=3, chunk_size=chunk)
    junk = _qkv(b=1, t=pad, seed=9)
    padded = [torch.cat([j, x], dim=2) for j, x in zip(junk, (q, k, v))]
    valid = torch.arange(21 + pad)[None, :] >= pad
    out, _ = sliding_window_chunked(*padded, window=5, sinks=3, chunk_size=chunk, key_valid=valid)
    ref = sliding_window_naive(*padded, window=5, sinks=3, key_valid=valid)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out[:, :, pad:], alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :, :pad], torch.zeros_like(out[:, :, :pad]))  # nothing visible yet


def test_softcap_matches_naive_and_bounds_scores():
    q, k, v = _qkv(t=26)
    capped, _ = sliding_window_chunked(5 * q, k, v, window=7, sinks=2, chunk_size=4, softcap=3.0)
    assert torch.allclose(capped, sliding_window_naive(5 * q, k, v, 7, 2, softcap=3.0), atol=1e-5, rtol=1e-5)
    plain, _ = sliding_window_chunked(5 * q, k, v, window=7, sinks=2, chunk_size=4)
    assert not torch.allclose(capped, plain, atol=1e-3)


def test_bad_window_raises():
    q, k, v = _qkv(t=4)
    with pytest.raises(ValueError, match="window"):
        sliding_window_chunked(q, k, v, window=0)


def test_softmax_reference_softcap_path_equals_naive_with_full_window():
    from torch import nn

    from dofla.models.student_attention import softmax_reference_forward

    q, k, v = _qkv(t=12)
    valid = torch.arange(12)[None, :] >= torch.tensor([[0], [3]])  # row 1 left-padded by 3
    causal = torch.arange(12)[None, :] <= torch.arange(12)[:, None]
    mask = (causal[None] & valid[:, None, :])[:, None]  # (B, 1, T, T) as Hugging Face builds it
    out, _ = softmax_reference_forward(nn.Module(), q, k, v, mask, 8 ** -0.5 / 2, 0.0, 0.5)  # head size 8
    ref = sliding_window_naive(q / 2, k, v, window=12, sinks=0, key_valid=valid, softcap=0.5)
    assert torch.allclose(out.transpose(1, 2)[1, :, 3:], ref[1, :, 3:], atol=1e-5, rtol=1e-5)
    assert torch.allclose(out.transpose(1, 2)[0], ref[0], atol=1e-5, rtol=1e-5)
