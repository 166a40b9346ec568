"""The ``output`` loss: relative squared error of the attention output, against plain references."""
from __future__ import annotations

import pytest
import torch

from dofla.attention.hybrid import hybrid_attention_naive
from dofla.attention.naive import linear_attention_naive, softmax_attention
from dofla.feature_maps import build_feature_map
from dofla.train.layerwise import LayerTrainConfig, layer_loss, needs_values, train_layer
from dofla.train.losses import LOSSES, teacher_logits


def _qkv(scale=1.5, t=30, d=16, h=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, t, d, generator=g) * s for s in (scale, scale, 1.0))


def _relative_sq(approx, exact):
    return (approx - exact).pow(2).sum() / exact.pow(2).sum()


@pytest.mark.parametrize("window,sinks", [(0, 0), (6, 0), (6, 2)])
def test_output_loss_matches_the_naive_attention_reference(window, sinks):
    q, k, v = _qkv()
    fm = build_feature_map("learned_prf", 2, 16, 24)
    lq, lk = fm.log_features(q), fm.log_features(k)
    if window:
        approx = hybrid_attention_naive(q, k, v, lq, lk, window, sinks=sinks)
    else:
        approx = linear_attention_naive(lq, lk, v)
    want = _relative_sq(approx, softmax_attention(q, k, v, causal=True))
    got = LOSSES.get("output")(lq, lk, q, k, window=window, sinks=sinks, v=v)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)


def test_output_loss_is_zero_for_an_exact_student_and_trains_at_real_norms():
    q, k, v = _qkv(scale=4.2, t=24, d=64)  # |x|²/sqrt(d) ≈ 140, the largest seen in SmolLM2
    s = teacher_logits(q, k)
    exact_k = (torch.full((24, 24), -1e4) + 1e4 * torch.eye(24)).expand(1, 2, 24, 24)
    assert LOSSES.get("output")(s, exact_k, q, k, v=v) < 1e-10  # K̂ = exp(s): Φ(k_j) = e_j
    fm = build_feature_map("learned_prf", 2, 64, 32)
    loss = LOSSES.get("output")(fm.log_features(q), fm.log_features(k), q, k, window=4, v=v)
    loss.backward()
    assert torch.isfinite(loss) and loss > 1e-4
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in fm.parameters())


def test_output_loss_needs_values_and_layer_loss_expands_gqa_values():
    q, k, v = _qkv()
    fm = build_feature_map("learned_prf", 2, 16, 24)
    with pytest.raises(ValueError, match="values"):
        LOSSES.get("output")(fm.log_features(q), fm.log_features(k), q, k)
    assert needs_values("output") and not needs_values("softmax") and not needs_values("l2")
    cfg = LayerTrainConfig(loss="output", window=6)
    with pytest.raises(ValueError, match="values v"):
        layer_loss(fm, q, k[:, :1], cfg)
    # one KV head shared by both query heads: the same as passing it expanded
    shared = layer_loss(fm, q, k[:, :1], cfg, v[:, :1])
    expanded = LOSSES.get("output")(fm.log_features(q), fm.log_features(k[:, :1].expand_as(k)), q,
                                    k[:, :1].expand_as(k), window=6, v=v[:, :1].expand_as(v))
    assert torch.allclose(shared, expanded)


def test_training_with_the_output_loss_lowers_heldout_output_error():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 2, 32, 16, generator=g) * s for s in (1.2, 1.2, 1.0))
    fm = build_feature_map("learned_prf", 2, 16, 16)
    result = train_layer(fm, q, k, LayerTrainConfig(loss="output", window=4, sinks=1, steps=40, eval_every=10,
                                                     warmup_steps=2), v=v)
    assert result.final_heldout_loss < 0.8 * result.initial_heldout_loss
