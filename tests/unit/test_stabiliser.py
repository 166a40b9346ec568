"""The causal stabiliser: a huge later key must not change what earlier rows compute.

Adversarial inputs put an outlier of 40–150 nats into one key feature far in a row's future (or,
for hybrid attention, inside its window). Every form must match the float64 log-space reference,
keep every denominator > 0 (a ones column of v must come out as exactly 1), and the losses must
keep a non-zero value and gradient on the rows before the outlier.
"""
from __future__ import annotations

import math

import pytest
import torch

from dofla.attention import (
    causal_log_kernel,
    hybrid_attention_chunked,
    hybrid_attention_naive,
    linear_attention_chunked,
    linear_attention_naive,
    linear_attention_recurrent,
    log_kernel_matrix,
)
from dofla.train.losses import LOSSES

B, H, M, D = 2, 2, 8, 4
GAPS = [40.0, 90.0, 120.0, 150.0]
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def _adversarial(t: int, gap: float, dtype, seed: int = 0, at: tuple[int, ...] | None = None):
    """log_q, log_k (B, H, T, M), v (B, H, T, D+1) with a ones column; key feature 2 of the keys
    at ``at`` (default: the middle and the second-to-last) is raised by ``gap`` nats, and the
    queries lean on feature 2 so that the outlier dominates every row that can see it."""
    g = torch.Generator().manual_seed(seed)
    log_q, log_k = (torch.randn(B, H, t, M, generator=g, dtype=dtype) for _ in range(2))
    for pos in at if at is not None else (t // 2, t - 2):
        log_k[:, :, pos, 2] += gap
    log_q[..., 2] += 3.0
    v = torch.randn(B, H, t, D, generator=g, dtype=dtype)
    return log_q, log_k, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def _check_rows(out, ref, dtype):
    assert torch.isfinite(out).all()
    assert _row_error(out, ref) < TOL[dtype]
    # the ones column is num/den with den > 0: an underflowed denominator would give 0 here
    torch.testing.assert_close(out[..., -1], torch.ones_like(out[..., -1]), rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("gap", GAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [37, 131])
def test_linear_forms_exact_with_a_far_future_outlier(gap, dtype, t):
    log_q, log_k, v = _adversarial(t, gap, dtype)
    ref = linear_attention_naive(log_q.double(), log_k.double(), v.double())
    for chunk in (1, 16, 64, 128):
        out, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=chunk)
        _check_rows(out, ref, dtype)
    _check_rows(linear_attention_recurrent(log_q, log_k, v)[0], ref, dtype)


@pytest.mark.parametrize("gap", [90.0, 150.0])
def test_chunked_gradients_exact_with_an_outlier(gap):
    log_q, log_k, v = _adversarial(45, gap, torch.float32, seed=1)
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(2))

    def grads(fn, *xs):
        leaves = [x.clone().requires_grad_(True) for x in xs]
        (fn(*leaves) * w.to(leaves[0].dtype)).sum().backward()
        return [x.grad for x in leaves]

    ref = grads(linear_attention_naive, log_q.double(), log_k.double(), v.double())
    got = grads(lambda a, b, c: linear_attention_chunked(a, b, c, chunk_size=16)[0], log_q, log_k, v)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.parametrize("gap", GAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window,chunk", [(4, 1), (8, 16), (16, 5), (5, 64)])
def test_hybrid_exact_with_an_in_window_outlier(gap, dtype, window, chunk):
    t = 41
    log_q, log_k, v = _adversarial(t, gap, dtype, seed=3, at=(20, 33))  # in the window of rows 20.. / 33..
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(B, H, t, 6, generator=g, dtype=dtype) for _ in range(2))
    ref = hybrid_attention_naive(*(x.double() for x in (q, k, v, log_q, log_k)), window)
    out, _ = hybrid_attention_chunked(q, k, v, log_q, log_k, window, chunk_size=chunk)
    _check_rows(out, ref, dtype)


@pytest.mark.parametrize("lag", [0, 3])
@pytest.mark.parametrize("gap", [90.0, 150.0])
def test_causal_log_kernel_matches_logsumexp_on_visible_pairs(lag, gap):
    log_q, log_k, _ = _adversarial(70, gap, torch.float32, seed=5)
    log_kernel, log_norm = causal_log_kernel(log_q, log_k, lag=lag, block=16)
    ref = log_kernel_matrix(log_q.double(), log_k.double())
    i, j = torch.arange(70)[:, None], torch.arange(70)[None, :]
    visible = j <= i - lag
    assert torch.isinf(log_kernel[..., ~visible]).all()
    # pairs within the fp32 range of their row's largest term are exact (others are floored)
    row_max = ref.masked_fill(~visible, -math.inf).amax(-1, keepdim=True)
    close = visible & (ref > row_max - 60)
    assert (log_kernel.double() - ref)[..., close].abs().max() < 1e-4
    want = torch.logsumexp(ref.masked_fill(~visible, -math.inf), -1, keepdim=True)
    torch.testing.assert_close(log_norm[..., lag:, :].double(), want[..., lag:, :], rtol=0, atol=1e-4)


def _reference_ce(log_q, log_k, q, k, window):
    """CE(p, p̂) from the plain log-space kernel, float64."""
    t = q.shape[2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    log_kernel = log_kernel_matrix(log_q, log_k)
    student = torch.where(j > i - window, s, log_kernel) if window else log_kernel
    p = torch.softmax(s.masked_fill(j > i, -math.inf), -1)
    log_p_hat = torch.log_softmax(student.masked_fill(j > i, -math.inf), -1).masked_fill(j > i, 0.0)
    return -(p * log_p_hat).sum(-1).mean()


@pytest.mark.parametrize("gap", GAPS)
@pytest.mark.parametrize("window", [0, 6])
def test_softmax_loss_keeps_early_rows_when_a_later_key_is_huge(gap, window):
    """Rows before the outlier must get the loss and gradient they get without it (causality),
    and those equal the float64 log-space reference."""
    t = 50
    log_q, log_k, _ = _adversarial(t, gap, torch.float32, seed=6, at=(t - 1,))
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(B, H, t, 6, generator=g) for _ in range(2))
    loss_fn = LOSSES.get("softmax")
    lq = log_q.clone().requires_grad_(True)
    total = loss_fn(lq, log_k, q, k, window=window) * t  # sum of the per-row losses
    total.backward()
    head = log_q[:, :, :-1].clone().requires_grad_(True)  # the first t−1 rows, outlier cut off
    total_head = loss_fn(head, log_k[:, :, :-1], q[:, :, :-1], k[:, :, :-1], window=window) * (t - 1)
    total_head.backward()
    ref_q = log_q[:, :, :-1].double().requires_grad_(True)
    ref = _reference_ce(ref_q, log_k[:, :, :-1].double(), q[:, :, :-1].double(), k[:, :, :-1].double(), window)
    (ref * (t - 1)).backward()
    assert abs(total_head.item() - ref.item() * (t - 1)) < 1e-4 * ref.item() * (t - 1)
    assert torch.isfinite(total) and total.item() > total_head.item()  # the last row adds a finite CE > 0
    early = lq.grad[:, :, :-1]
    assert early[:, :, max(1, window):].abs().sum(-1).gt(0).all()  # every row with a choice to learn
    torch.testing.assert_close(early, head.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(early.double(), ref_q.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("scale", ["row_max", "rows"])
@pytest.mark.parametrize("gap", [90.0, 150.0])
def test_l2_loss_rows_before_a_huge_key_keep_their_gradient(scale, gap):
    t = 40
    log_q, log_k, _ = _adversarial(t, gap, torch.float32, seed=8, at=(t - 1,))
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(B, H, t, 6, generator=g) for _ in range(2))
    lq = log_q.clone().requires_grad_(True)
    LOSSES.get("l2")(lq, log_k, q, k, scale=scale).backward()
    early = lq.grad[:, :, 1: t - 1]  # row 0 sees one key only; the last row sees the outlier
    assert torch.isfinite(early).all() and (early.abs().sum(-1) > 0).all()  # every earlier row still trains


def test_exact_rows_in_small_groups_give_the_same_result(monkeypatch):
    """The exact recomputation runs in memory-bounded groups of rows; grouping must not matter."""
    from dofla.attention import stable

    log_q, log_k, v = _adversarial(64, 150.0, torch.float32, seed=10, at=(10, 40, 50))
    whole, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=64)
    monkeypatch.setattr(stable, "EXACT_ELEMENTS", 3 * 64 * M)  # three rows per group
    grouped, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=64)
    assert torch.equal(whole, grouped)
    _check_rows(grouped, linear_attention_naive(log_q.double(), log_k.double(), v.double()), torch.float32)
