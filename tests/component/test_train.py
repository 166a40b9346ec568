"""Layerwise training from activations, exact resume, non-finite detection, direct training."""
from __future__ import annotations

import pytest
import torch

from dofla.eval.metrics import relative_error
from dofla.attention import linear_attention_chunked, softmax_attention
from dofla.feature_maps import build_feature_map
from dofla.models import convert
from dofla.train import (
    LayerTrainConfig,
    NonFiniteLossError,
    run_layerwise,
    train_direct,
    train_layer,
)


def realistic_qk(seqs=8, heads=3, kv_heads=1, length=48, d=16, seed=0):
    """Post-RoPE-like activations: a few large-norm directions shared across tokens."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(1, heads, 1, d, generator=g) * 2.0
    q = torch.randn(seqs, heads, length, d, generator=g) + bias
    k = torch.randn(seqs, kv_heads, length, d, generator=g) + bias[:, :kv_heads] * 1.5
    return q, k


def _attention_error(fm, q, k):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = torch.randn_like(k)
    with torch.no_grad():
        out, _ = linear_attention_chunked(fm.log_features(q), fm.log_features(k), v)
    return relative_error(out, softmax_attention(q, k, v))


def test_training_reduces_heldout_loss_and_attention_error():
    q, k = realistic_qk()
    fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
    before = _attention_error(fm, q[-2:], k[-2:])
    cfg = LayerTrainConfig(steps=60, eval_every=10, warmup_steps=5, heldout_fraction=0.25)
    result = train_layer(fm, q, k, cfg)
    assert result.final_heldout_loss < result.initial_heldout_loss
    assert _attention_error(fm, q[-2:], k[-2:]) < before
    assert result.curve[-1]["step"] == 59


def test_resume_from_checkpoint_is_bit_identical(tmp_path, monkeypatch):
    q, k = realistic_qk()
    cfg = LayerTrainConfig(steps=12, eval_every=4, checkpoint_every=6, warmup_steps=2)
    full = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg)
    ckpt = tmp_path / "layer.ckpt"

    class Killed(Exception):
        pass

    def interrupt(point):  # stands in for the SIGKILL of the CLI-level test, in-process
        if point == "train:layer:step8":
            raise Killed

    monkeypatch.setattr("dofla.train.layerwise.kill_point", interrupt)
    with pytest.raises(Killed):
        train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, checkpoint_path=ckpt)
    monkeypatch.undo()
    resumed = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, checkpoint_path=ckpt)
    for name in full.state_dict:
        assert torch.equal(full.state_dict[name], resumed.state_dict[name])
    assert full.curve == resumed.curve


def test_non_finite_loss_is_reported_with_layer_and_step():
    q, k = realistic_qk()
    q[0, 0, 0, 0] = float("nan")
    cfg = LayerTrainConfig(steps=20, heldout_fraction=0.0, batch_size=8)
    with pytest.raises(NonFiniteLossError, match="layer7: non-finite training loss at step 0"):
        train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, desc="layer7")
    skipped = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k,
                          LayerTrainConfig(steps=3, heldout_fraction=0.0, batch_size=8, skip_nonfinite=True))
    assert all(c.get("skipped") for c in skipped.curve)


def test_run_layerwise_writes_artifacts_then_skips(tmp_path):
    acts = {i: realistic_qk(seed=i) for i in range(2)}
    seen = []

    def activations(i):
        seen.append(i)
        return acts[i]

    fms = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    cfg = LayerTrainConfig(steps=4, eval_every=2)
    run_layerwise(fms, activations, [0, 1], cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["layer_00.pt", "layer_01.pt"]
    run_layerwise(fms, activations, [0, 1], cfg, tmp_path)
    assert seen == [0, 1]


def test_direct_training_moves_only_feature_parameters():
    from dofla.models.tiny import build_tiny_model

    student = convert(build_tiny_model("llama"), feature_map="learned_prf", dims=[8, 8])
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    tokens = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(0))
    curve = train_direct(student, tokens, LayerTrainConfig(steps=25, batch_size=3, warmup_steps=2))
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".dofla.feature_map." in n for n in changed)
    assert sum(c["loss"] for c in curve[-5:]) < sum(c["loss"] for c in curve[:5])
