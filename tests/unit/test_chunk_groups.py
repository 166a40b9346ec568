"""The chunked kernel batches its chunks in groups (``groups.GROUP_TOKENS``): the in-chunk work of a
group at once, only the carried state chunk by chunk. With groups of a few chunks, a sequence spans
several groups, a last partial chunk, and a group that falls back to chunk by chunk because an
outlier key sends one of its chunks down the stabiliser's guarded path; every combination must
match the float64 quadratic reference in value and gradient, with a carried state, the gate and
padding, and deciding ahead (the device path) must compute exactly what deciding on the way does.
"""
from __future__ import annotations

import pytest
import torch

from dofla.attention import groups, linear, stable
from dofla.attention import linear_attention_chunked, linear_attention_naive

B, H, M, D = 2, 3, 6, 5


@pytest.fixture
def small_groups(monkeypatch):
    monkeypatch.setattr(groups, "GROUP_TOKENS", 16)  # groups of 4 chunks of 4, or 2 of 8


def _inputs(t: int, seed: int, outlier: int | None):
    g = torch.Generator().manual_seed(seed)
    log_q, log_k = (torch.randn(B, H, t, M, generator=g, dtype=torch.float64) for _ in range(2))
    if outlier is not None:  # a key that dwarfs its chunk's first key: that chunk's rows are guarded
        log_k[:, :, outlier, 1] += 120.0
        log_q[..., 1] += 2.0
    v = torch.randn(B, H, t, D, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, H, t, generator=g, dtype=torch.float64)
    return log_q, log_k, v, decay


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _run(log_q, log_k, v, decay, valid, chunk, split):
    """The kernel over [0, split) then [split, T) from the carried state, in float32."""
    f32 = [None if x is None else x.float() for x in (log_q, log_k, v, decay)]
    parts = []
    state = None
    for lo, hi in ((0, split), (split, log_q.shape[2])):
        cut = [None if x is None else x[:, :, lo:hi] for x in f32]
        out, state = linear_attention_chunked(*cut[:3], chunk_size=chunk, state=state, log_decay=cut[3],
                                              key_valid=None if valid is None else valid[:, lo:hi])
        parts.append(out)
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("outlier", [None, 21])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_chunks_match_the_reference(small_groups, chunk, gated, outlier, padded):
    t, split = 59, 13  # several groups, partial chunks, a carried state in the middle of a chunk
    log_q, log_k, v, decay = _inputs(t, seed=chunk + 10 * gated, outlier=outlier)
    decay = decay if gated else None
    valid = None
    if padded:
        valid = torch.ones(B, t, dtype=torch.bool)
        valid[1, :9] = False  # left padding of the second row
    leaves = [x.clone().requires_grad_(True) for x in (log_q, log_k, v)]
    ref = linear_attention_naive(*leaves, key_valid=valid, log_decay=decay)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    leaves32 = [x.float().requires_grad_(True) for x in (log_q, log_k, v)]
    out = _run(*leaves32, decay, valid, chunk, split)
    got = torch.autograd.grad((out * w.float()).sum(), leaves32)
    rows = slice(None) if valid is None else valid[:, None, :, None].expand_as(ref)
    assert _rel(out.double()[rows], ref.detach()[rows]) < 2e-5
    for g32, g64 in zip(got, want):
        assert torch.isfinite(g32).all() and _rel(g32, g64) < 1e-4


def test_a_group_with_a_guarded_chunk_goes_chunk_by_chunk(small_groups, monkeypatch):
    """The same outputs whether the group's chunks are batched or taken one by one (the fallback),
    and the outlier's group does fall back."""
    log_q, log_k, v, _ = (x.float() for x in _inputs(64, seed=5, outlier=37))
    calls = []
    one_by_one = linear._chunks_one_by_one
    monkeypatch.setattr(linear, "_chunks_one_by_one", lambda *a: calls.append(a[0].shape[2]) or one_by_one(*a))
    grouped, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=4)
    assert calls == [16]  # the third group of 16 tokens holds the outlier
    monkeypatch.setattr(groups, "GROUP_TOKENS", 4)  # one chunk per group
    single, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=4)
    assert _rel(grouped, single.double()) < 1e-6


@pytest.mark.parametrize("gated", [False, True])
def test_deciding_ahead_with_groups_is_bitwise_the_same(small_groups, monkeypatch, gated):
    log_q, log_k, v, decay = (x.float() for x in _inputs(50, seed=7, outlier=30))
    decay = decay if gated else None
    here, state = linear_attention_chunked(log_q, log_k, v, chunk_size=4, log_decay=decay)
    monkeypatch.setattr(stable, "AHEAD_ON_CPU", True)
    ahead, state_ahead = linear_attention_chunked(log_q, log_k, v, chunk_size=4, log_decay=decay)
    assert torch.equal(here, ahead) and torch.equal(state.kv, state_ahead.kv)
    assert torch.equal(state.offset, state_ahead.offset)
