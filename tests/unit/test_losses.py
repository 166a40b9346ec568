"""Layerwise losses: finite at real norms, correct at known optima, log-space kernel exact."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.attention import log_kernel_matrix
from dofla.attention.hybrid import hybrid_log_scores
from dofla.feature_maps import build_feature_map
from dofla.train.losses import LOSSES, log_student_kernel, teacher_logits


def _qk(scale, t=32, d=64, h=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=g) * scale, torch.randn(1, h, t, d, generator=g) * scale


def test_log_student_kernel_matches_logsumexp_reference():
    q, k = _qk(1.0, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    lq, lk = fm.log_features(q), fm.log_features(k)
    assert torch.allclose(log_student_kernel(lq, lk), log_kernel_matrix(lq, lk), atol=1e-4)


@pytest.mark.parametrize("name", ["softmax", "l2"])
@pytest.mark.parametrize("window", [0, 4])
def test_losses_finite_with_gradients_at_real_norms(name, window):
    q, k = _qk(scale=4.2)  # |x|²/sqrt(d) ≈ 140, the largest seen in SmolLM2
    fm = build_feature_map("learned_prf", 2, 64, 64)
    loss = LOSSES.get(name)(fm.log_features(q), fm.log_features(k), q, k, window=window)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in fm.parameters())


def test_softmax_loss_is_teacher_entropy_when_student_is_exact():
    q, k = _qk(1.0, d=16)
    s = q @ k.transpose(-1, -2) / 4.0
    exact_log_kernel = s  # a "student" whose log K̂ equals the teacher's scores
    mask = torch.ones(32, 32).tril().bool()
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
    # feed it through the loss with a window covering everything: the student is the teacher
    loss = LOSSES.get("softmax")(torch.zeros(1, 2, 32, 4), torch.zeros(1, 2, 32, 4), q, k, window=32)
    assert torch.allclose(loss, entropy, atol=1e-5)
    assert exact_log_kernel.shape == (1, 2, 32, 32)


def _entropy(s, causal=True):
    """Mean row entropy of the teacher's (causal) attention distribution; s (B, H, L, L) scores."""
    mask = torch.ones(s.shape[-1], s.shape[-1]).tril().bool() if causal else torch.ones(s.shape[-2:]).bool()
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_loss_is_teacher_entropy_for_an_exact_feature_kernel(causal):
    """One feature per key: Φ(k_j) = e_j, Φ(q_i)_j = exp(s_ij), so K̂ = K exactly through the K̂ path."""
    q, k = _qk(3.0, t=24, d=16)  # |x|²/sqrt(d) ≈ 36: the shifts must keep this exact
    s = q @ k.transpose(-1, -2) / 4.0
    log_q = s
    log_k = torch.full((1, 2, 24, 24), -1e4) + 1e4 * torch.eye(24)
    loss = LOSSES.get("softmax")(log_q, log_k, q, k, causal=causal)
    assert torch.allclose(loss, _entropy(s, causal), atol=1e-4)


@pytest.mark.parametrize("causal, t, softcap", [(True, 32, None), (False, 32, None), (True, 300, None),
                                               (True, 300, 3.0)])
def test_softmax_loss_fast_path_matches_log_softmax_reference(causal, t, softcap):
    """The fast path (row shift cancelled, normaliser per block, the teacher's softmax assembled per
    piece of rows and keys, never as an (L, L) matrix) against the plain log-softmax cross-entropy: same value, same gradients. (At the longer length a
    smaller scale keeps every student entry above the e^-20 floor the reference does not have.)"""
    q, k = _qk(2.0 if t < 128 else 1.0, t=t, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    mask = torch.ones(t, t).tril().bool() if causal else torch.ones(t, t).bool()
    s = teacher_logits(q, k, softcap)
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)

    def reference():
        lq, lk = fm.log_features(q), fm.log_features(k)
        log_p_hat = torch.log_softmax(log_kernel_matrix(lq, lk).masked_fill(~mask, -math.inf), -1)
        return -(p * log_p_hat.masked_fill(~mask, 0.0)).sum(-1).mean()

    def fast():
        return LOSSES.get("softmax")(fm.log_features(q), fm.log_features(k), q, k, causal=causal, softcap=softcap)

    values, grads = [], []
    for loss_fn in (reference, fast):
        fm.zero_grad()
        loss = loss_fn()
        loss.backward()
        values.append(loss.detach())
        grads.append([p_.grad.clone() for p_ in fm.parameters()])
    assert torch.allclose(values[1], values[0], atol=1e-4)
    assert all(torch.allclose(b, a, rtol=1e-3, atol=1e-5) for a, b in zip(*grads))


@pytest.mark.parametrize("feature_map", ["performer", "learned_prf", "hedgehog", "elu1"])
def test_cross_entropy_bounds_teacher_entropy_and_l2_is_nonnegative(feature_map):
    q, k = _qk(4.2)
    fm = build_feature_map(feature_map, 2, 64, 32)
    lq, lk = fm.log_features(q), fm.log_features(k)
    teacher_entropy = _entropy(q @ k.transpose(-1, -2) / 8.0)
    assert LOSSES.get("softmax")(lq, lk, q, k) >= teacher_entropy - 1e-4  # Gibbs: CE(p, p̂) ≥ H(p)
    for scale in ("row_max", "none"):
        value = LOSSES.get("l2")(lq, lk, q, k, scale=scale)
        assert torch.isfinite(value) and value >= 0


def test_l2_scales_agree_on_which_student_is_better():
    q, k = _qk(0.5, d=16)
    good = build_feature_map("performer", 2, 16, 4096, seed=1)
    bad = build_feature_map("performer", 2, 16, 2, seed=1)
    for scale in ("row_max", "none"):
        losses = [LOSSES.get("l2")(fm.log_features(q), fm.log_features(k), q, k, scale=scale)
                  for fm in (good, bad)]
        assert losses[0] < losses[1]


def test_teacher_logits_softcap():
    q, k = _qk(3.0, d=16)
    raw = teacher_logits(q, k)
    capped = teacher_logits(q, k, softcap=5.0)
    assert raw.abs().max() > 5.0 and capped.abs().max() < 5.0
    torch.testing.assert_close(capped, 5.0 * torch.tanh(raw / 5.0))
    with pytest.raises(ValueError, match="softcap"):
        teacher_logits(q, k, softcap=0.0)


def test_softmax_loss_distils_against_the_capped_teacher():
    """With a window covering everything the student is the (capped) teacher: CE = its entropy."""
    q, k = _qk(3.0, t=24, d=16)
    zeros = torch.zeros(1, 2, 24, 4)
    capped = teacher_logits(q, k, softcap=4.0)
    loss = LOSSES.get("softmax")(zeros, zeros, q, k, window=24, softcap=4.0)
    assert torch.allclose(loss, _entropy(capped), atol=1e-5)
    assert not torch.allclose(loss, _entropy(teacher_logits(q, k)), atol=1e-2)


def _one_hot_student(s):
    """log_q, log_k with K̂ = exp(s) exactly: Φ(k_j) = e_j, Φ(q_i)_j = exp(s_ij)."""
    t = s.shape[-1]
    return s.clone(), (torch.full((t, t), -1e4) + 1e4 * torch.eye(t)).expand(*s.shape[:2], t, t).clone()


@pytest.mark.parametrize("window", [0, 5])
def test_l2_rows_is_zero_for_an_exact_student_and_has_finite_gradients(window):
    q, k = _qk(3.0, t=24, d=16)
    log_q, log_k = _one_hot_student(teacher_logits(q, k))
    assert LOSSES.get("l2")(log_q, log_k, q, k, window=window, scale="rows") < 1e-10
    fm = build_feature_map("learned_prf", 2, 16, 24)
    loss = LOSSES.get("l2")(fm.log_features(q), fm.log_features(k), q, k, window=window, scale="rows")
    loss.backward()
    assert loss > 1e-3 and all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in fm.parameters())


def test_l2_rows_matches_plain_reference():
    q, k = _qk(2.0, t=20, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    lq, lk = fm.log_features(q), fm.log_features(k)
    mask = torch.ones(20, 20).tril().bool()
    p = torch.softmax(teacher_logits(q, k).masked_fill(~mask, -math.inf), -1)
    p_hat = torch.softmax(log_kernel_matrix(lq, lk).masked_fill(~mask, -math.inf), -1)
    want = (p - p_hat).pow(2).sum(-1).mean()
    assert torch.allclose(LOSSES.get("l2")(lq, lk, q, k, scale="rows"), want, atol=1e-6)
    with pytest.raises(ValueError, match="scale"):
        LOSSES.get("l2")(lq, lk, q, k, scale="row")


@pytest.mark.parametrize("sinks", [1, 4])
def test_hybrid_softmax_loss_with_sinks_matches_reference(sinks):
    """Sink keys are exact in the loss, as in hybrid attention: compare with the quadratic
    reference's log scores (hybrid_log_scores with the same sinks)."""
    q, k = _qk(1.5, t=30, d=16)
    fm = build_feature_map("learned_prf", 2, 16, 24)
    lq, lk = fm.log_features(q), fm.log_features(k)
    student = hybrid_log_scores(q, k, lq, lk, 6, sinks=sinks)
    mask = torch.ones(30, 30).tril().bool()
    p = torch.softmax(teacher_logits(q, k).masked_fill(~mask, -math.inf), -1)
    want = -(p * torch.log_softmax(student, -1).masked_fill(~mask, 0.0)).sum(-1).mean()
    got = LOSSES.get("softmax")(lq, lk, q, k, window=6, sinks=sinks)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, LOSSES.get("softmax")(lq, lk, q, k, window=6), atol=1e-4)
    with pytest.raises(ValueError, match="sinks"):
        LOSSES.get("softmax")(lq, lk, q, k, sinks=2)  # no window: nothing is exact



def test_module_device_is_where_parameters_or_buffers_live():
    """layer_loss moves host-memory activations to this device (a GPU is not available to test the move)."""
    from dofla.train.layerwise import module_device

    assert module_device(build_feature_map("learned_prf", 2, 16, 8).to("meta")).type == "meta"
    performer = build_feature_map("performer", 2, 16, 8)  # random directions: buffers, no parameters
    assert not list(performer.parameters()) and module_device(performer.to("meta")).type == "meta"
    assert module_device(torch.nn.Identity()) == torch.device("cpu")
