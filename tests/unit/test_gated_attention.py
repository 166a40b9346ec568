"""Gated linear attention (a per-head, per-token decay of the state): the chunked and recurrent
kernels against the quadratic reference, in value and gradient, on odd sizes, at strong decays, across
a carried state, with padding; zero decay is the ungated kernel exactly."""
from __future__ import annotations

import pytest
import torch

from dofla.attention import linear_attention_chunked, linear_attention_naive, linear_attention_recurrent


def inputs(b=2, h=3, t=37, m=5, dv=4, decay=0.3, seed=0, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    log_q = torch.randn(b, h, t, m, generator=g, dtype=dtype) * scale
    log_k = torch.randn(b, h, t, m, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, t, dv, generator=g, dtype=dtype)
    log_decay = -decay * torch.rand(b, h, t, generator=g, dtype=dtype)
    return log_q, log_k, v, log_decay


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
@pytest.mark.parametrize("decay", [0.05, 0.3, 5.0])
def test_chunked_and_recurrent_equal_the_reference(chunk, decay):
    log_q, log_k, v, a = inputs(decay=decay)
    reference = linear_attention_naive(log_q, log_k, v, log_decay=a)
    chunked, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=chunk, log_decay=a)
    torch.testing.assert_close(chunked, reference, rtol=1e-9, atol=1e-10)
    if chunk == 4:
        recurrent, _ = linear_attention_recurrent(log_q, log_k, v, log_decay=a)
        torch.testing.assert_close(recurrent, reference, rtol=1e-9, atol=1e-10)


def test_the_decay_changes_the_output_and_zero_decay_is_the_ungated_kernel():
    log_q, log_k, v, a = inputs()
    ungated, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=8)
    zero, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=8, log_decay=torch.zeros_like(a))
    gated, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=8, log_decay=a)
    torch.testing.assert_close(zero, ungated, rtol=0, atol=0)
    assert (gated - ungated).abs().max() > 1e-2


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_gradients_equal_the_references(form):
    tensors = [x.requires_grad_() for x in inputs(t=19)]
    ref_tensors = [x.detach().clone().requires_grad_() for x in tensors]
    weights = torch.randn(2, 3, 19, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    log_q, log_k, v, a = tensors
    if form == "chunked":
        out, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=5, log_decay=a)
    else:
        out, _ = linear_attention_recurrent(log_q, log_k, v, log_decay=a)
    (out * weights).sum().backward()
    lq, lk, rv, ra = ref_tensors
    (linear_attention_naive(lq, lk, rv, log_decay=ra) * weights).sum().backward()
    for mine, ref, name in zip(tensors, ref_tensors, ("log_q", "log_k", "v", "log_decay")):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-8, atol=1e-9, msg=name)
    assert ref_tensors[3].grad.abs().max() > 1e-3  # the gate does get a gradient


def test_a_carried_state_continues_the_sequence_at_any_split():
    log_q, log_k, v, a = inputs(t=41, decay=1.0)
    whole, final = linear_attention_chunked(log_q, log_k, v, chunk_size=8, log_decay=a)
    first, state = linear_attention_chunked(log_q[:, :, :13], log_k[:, :, :13], v[:, :, :13], chunk_size=8,
                                            log_decay=a[:, :, :13])
    parts = [first]
    for t in range(13, 41):  # then token by token, as decoding does
        out, state = linear_attention_recurrent(log_q[:, :, t:t + 1], log_k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                state, log_decay=a[:, :, t:t + 1])
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-9, atol=1e-10)
    assert state.length == final.length == 41


def test_long_sequences_at_strong_decay_stay_exact_in_float32():
    log_q, log_k, v, a = inputs(b=1, h=2, t=1500, decay=4.0, dtype=torch.float32, scale=6.0)
    reference = linear_attention_naive(log_q.double(), log_k.double(), v.double(), log_decay=a.double())
    chunked, state = linear_attention_chunked(log_q, log_k, v, chunk_size=128, log_decay=a)
    assert torch.isfinite(chunked).all() and torch.isfinite(state.offset).all()
    torch.testing.assert_close(chunked.double(), reference, rtol=1e-4, atol=1e-4)


def test_padding_keys_neither_contribute_nor_decay():
    log_q, log_k, v, a = inputs(b=1, t=12)
    pads = 5
    padded = [torch.cat([x[:, :, :1].expand(-1, -1, pads, *x.shape[3:]) * 7, x], dim=2) for x in (log_q, log_k, v, a)]
    valid = torch.tensor([[False] * pads + [True] * 12])
    out, _ = linear_attention_chunked(*padded[:3], chunk_size=4, key_valid=valid, log_decay=padded[3])
    alone, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=4, log_decay=a)
    torch.testing.assert_close(out[:, :, pads:], alone, rtol=1e-9, atol=1e-10)
    reference = linear_attention_naive(*padded[:3], key_valid=valid, log_decay=padded[3])
    torch.testing.assert_close(reference[:, :, pads:], alone, rtol=1e-9, atol=1e-10)
