"""The distill stage's targets (``dofla.train.kl_targets``): the fused exact KL against the plain
composed KL, the top-k KL against a plain reference of the same formula, values and gradients in
float64 at odd sizes, and the top-k KL's relation to the exact one."""
from __future__ import annotations

import pytest
import torch

from dofla.errors import ConfigError
from dofla.train.distill import kl_reference, kl_to_teacher
from dofla.train.kl_targets import ExactTargets, exact_kl, topk_kl_reference, topk_targets


def logits(shape, seed, scale=3.0, dtype=torch.float64):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def value_and_grad(loss_of, z):
    z = z.detach().clone().requires_grad_(True)
    loss = loss_of(z)
    loss.backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_the_fused_exact_kl_gives_the_plain_kl_and_its_gradient(temperature):
    z, t = logits((3, 7, 53), 0), logits((3, 7, 53), 1)
    got, got_grad = value_and_grad(lambda x: exact_kl(x, t, temperature), z)
    want, want_grad = value_and_grad(lambda x: kl_reference(x, t, temperature), z)
    assert got.dtype == torch.float64 and got > 0.1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
    assert exact_kl(t, t, temperature).item() == pytest.approx(0.0, abs=1e-12)


def test_the_fused_exact_kl_matches_the_composed_one_in_float32_and_under_bfloat16_logits():
    z, t = logits((2, 5, 301), 2, dtype=torch.float32), logits((2, 5, 301), 3, dtype=torch.float32)
    got, got_grad = value_and_grad(lambda x: exact_kl(x, t), z)
    want, want_grad = value_and_grad(lambda x: kl_to_teacher(x, t), z)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)
    half, half_grad = value_and_grad(lambda x: exact_kl(x, t.bfloat16()), z.bfloat16())
    assert half.dtype == torch.float32 and half_grad.dtype == torch.bfloat16  # the loss in float32
    torch.testing.assert_close(half, kl_to_teacher(z.bfloat16(), t.bfloat16()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k, temperature", [(1, 1.0), (5, 1.0), (5, 2.0), (40, 1.0)])
def test_the_topk_kl_is_the_plain_k_plus_one_bucket_kl(k, temperature):
    z, t = logits((2, 9, 47), 4), logits((2, 9, 47), 5)
    targets = topk_targets(t, k, temperature)
    got, got_grad = value_and_grad(lambda x: targets.kl(x, temperature), z)
    want, want_grad = value_and_grad(lambda x: topk_kl_reference(x, t, k, temperature), z)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-8, atol=1e-14)


def test_the_topk_kl_bounds_the_exact_kl_from_below_and_reaches_it_with_the_whole_mass():
    z, t = logits((4, 6, 64), 6), logits((4, 6, 64), 7)
    exact = exact_kl(z, t).item()
    values = [topk_targets(t, k).kl(z, 1.0).item() for k in (1, 8, 32, 63)]
    assert all(v <= exact + 1e-12 for v in values)
    assert values == sorted(values)  # finer buckets, larger KL
    assert values[-1] == pytest.approx(exact, rel=1e-12)  # k = V − 1: the rest is one token


def test_topk_targets_keep_the_teachers_most_likely_tokens_and_the_rest_of_the_mass():
    t = logits((1, 4, 30), 8)
    targets = topk_targets(t, 6, 2.0)
    p = torch.softmax(t / 2.0, dim=-1)
    torch.testing.assert_close(targets.ids.long(), p.topk(6).indices)
    torch.testing.assert_close(targets.log_probs.exp(), p.topk(6).values)
    torch.testing.assert_close(targets.log_rest.exp(), 1 - p.topk(6).values.sum(-1))
    assert targets.ids.dtype == torch.int32


def test_a_part_of_the_positions_is_that_parts_targets():
    z, t = logits((2, 10, 20), 9), logits((2, 10, 20), 10)
    targets = topk_targets(t, 4)
    part = slice(3, 8)
    assert targets.part(part).kl(z[:, part], 1.0).item() == pytest.approx(
        topk_targets(t[:, part], 4).kl(z[:, part], 1.0).item(), rel=1e-12)
    assert ExactTargets(t).part(part).kl(z[:, part], 1.0).item() == pytest.approx(
        exact_kl(z[:, part], t[:, part]).item(), rel=1e-12)


@pytest.mark.parametrize("k", [0, 20, 25])
def test_a_topk_outside_the_vocabulary_is_refused(k):
    with pytest.raises(ConfigError, match="teacher_topk"):
        topk_targets(logits((1, 2, 20), 0), k)
