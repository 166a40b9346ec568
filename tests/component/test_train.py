"""Layerwise training from activations, exact resume, non-finite detection, direct training."""
from __future__ import annotations

import pytest
import torch

from dofla.eval import layer_attention_error
from dofla.feature_maps import build_feature_map
from dofla.models import convert
from dofla.data.stream import BatchStream
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train import (
    LayerTrainConfig,
    NonFiniteLossError,
    run_layerwise,
    train_direct,
    train_layer,
)


class Killed(Exception):
    """Stands in, in-process, for the SIGKILL of the CLI-level resume test."""


def realistic_qk(seqs=8, heads=3, kv_heads=1, length=48, d=16, seed=0):
    """Post-RoPE-like activations: a few large-norm directions shared across tokens."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(1, heads, 1, d, generator=g) * 2.0
    q = torch.randn(seqs, heads, length, d, generator=g) + bias
    k = torch.randn(seqs, kv_heads, length, d, generator=g) + bias[:, :kv_heads] * 1.5
    return q, k


def _attention_error(fm, q, k):
    values = torch.randn(k.shape, generator=torch.Generator().manual_seed(5))
    return layer_attention_error(fm, q, k, values)


def _kill_at(monkeypatch, point: str) -> None:
    """Every trainer's kill points are its loop's (dofla.train.loop)."""
    def interrupt(name):
        if name == point:
            raise Killed

    monkeypatch.setattr("dofla.train.loop.kill_point", interrupt)


def test_training_reduces_heldout_loss_and_attention_error():
    q, k = realistic_qk()
    fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
    before = _attention_error(fm, q[-2:], k[-2:])
    cfg = LayerTrainConfig(steps=60, eval_every=10, warmup_steps=5, heldout_fraction=0.25)
    result = train_layer(fm, q, k, cfg)
    assert result.final_heldout_loss < result.initial_heldout_loss
    assert _attention_error(fm, q[-2:], k[-2:]) < before
    assert result.curve[-1]["step"] == 59 and "heldout_loss" in result.curve[-1]


def test_untrainable_feature_map_returns_its_initial_loss():
    q, k = realistic_qk()
    result = train_layer(build_feature_map("performer", 3, 16, 8), q, k, LayerTrainConfig(steps=50))
    assert result.steps_run == 0 and result.curve == []
    assert result.final_heldout_loss == result.initial_heldout_loss


def test_resume_from_checkpoint_is_bit_identical(tmp_path, monkeypatch):
    q, k = realistic_qk()
    cfg = LayerTrainConfig(steps=12, eval_every=4, checkpoint_every=6, warmup_steps=2)
    full = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg)
    ckpt = tmp_path / "layer.ckpt"
    _kill_at(monkeypatch, "train:layer:step8")
    with pytest.raises(Killed):
        train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, checkpoint_path=ckpt)
    monkeypatch.undo()
    resumed = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, checkpoint_path=ckpt)
    for name in full.state_dict:
        assert torch.equal(full.state_dict[name], resumed.state_dict[name])
    assert full.curve == resumed.curve and full.best_step == resumed.best_step


def test_non_finite_loss_is_reported_with_layer_and_step():
    q, k = realistic_qk()
    q[0, 0, 0, 0] = float("inf")
    cfg = LayerTrainConfig(steps=20, heldout_fraction=0.0, batch_size=8)
    with pytest.raises(NonFiniteLossError, match="layer7: non-finite training loss at step 0"):
        train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, desc="layer7")
    fm = build_feature_map("learned_prf", 3, 16, 8)
    initial = {n: t.clone() for n, t in fm.state_dict().items()}
    skipped = train_layer(fm, q, k, LayerTrainConfig(steps=3, heldout_fraction=0.0, batch_size=8,
                                                     skip_nonfinite=True))
    assert all(c.get("skipped") for c in skipped.curve)
    assert all(torch.equal(initial[n], t) for n, t in fm.state_dict().items())


def test_run_layerwise_writes_artifacts_then_skips(tmp_path):
    acts = {i: realistic_qk(seed=i) for i in range(2)}
    seen = []

    def activations(i):
        seen.append(i)
        return acts[i]

    fms = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    cfg = LayerTrainConfig(steps=4, eval_every=2)
    first = run_layerwise(fms, activations, [0, 1], cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["layer_00.pt", "layer_01.pt"]
    fresh = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    second = run_layerwise(fresh, activations, [0, 1], cfg, tmp_path)
    assert seen == [0, 1] and first == second
    assert all(torch.equal(a.z, b.z) for a, b in zip(fms, fresh))


def _tiny_student():
    return convert(build_tiny_model("llama"), feature_map="learned_prf", dims=[8, 8])


def _tokens():
    return torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(0))


def test_direct_training_moves_only_feature_parameters():
    student = _tiny_student()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    curve = train_direct(student, _tokens(), LayerTrainConfig(steps=25, batch_size=3, warmup_steps=2))
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".dofla.feature_map." in n for n in changed)
    assert sum(c["loss"] for c in curve[-5:]) < sum(c["loss"] for c in curve[:5])


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_direct_training_resumes_bit_identically(tmp_path, monkeypatch, schedule):
    # the checkpoint (step 3) falls inside the warm-up: the resumed rates must be the schedule's
    cfg = LayerTrainConfig(steps=6, batch_size=2, warmup_steps=4, checkpoint_every=3, schedule=schedule)
    full_student = _tiny_student()
    full = train_direct(full_student, _tokens(), cfg)
    ckpt = tmp_path / "direct.ckpt"
    _kill_at(monkeypatch, "train:direct:step4")
    with pytest.raises(Killed):
        train_direct(_tiny_student(), _tokens(), cfg, checkpoint_path=ckpt)
    monkeypatch.undo()
    student = _tiny_student()
    assert train_direct(student, _tokens(), cfg, checkpoint_path=ckpt) == full
    expected = full_student.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in student.state_dict().items())


def _stream(batch_size=2, seq_len=24):
    texts = [f"chapter {i}: the quick brown fox jumps over the lazy dog, and the dog sleeps on" for i in range(30)]
    return BatchStream(lambda: iter(texts), build_byte_tokenizer(), batch_size, seq_len)


def test_direct_training_on_a_stream_takes_each_fresh_batch_once_and_resumes(tmp_path, monkeypatch):
    cfg = LayerTrainConfig(steps=6, batch_size=2, warmup_steps=2, checkpoint_every=3)
    stream, full_student = _stream(), _tiny_student()
    full = train_direct(full_student, stream, cfg)
    assert len(full) == 6 and stream.position == 6  # six batches served, in order, none twice
    first = _stream().next_batch()  # step 0's loss is the untrained student's loss on the first batch
    with torch.no_grad():
        assert full[0]["loss"] == pytest.approx(_tiny_student()(input_ids=first, labels=first).loss.item(), rel=1e-6)
    ckpt = tmp_path / "direct.ckpt"
    _kill_at(monkeypatch, "train:direct:step4")
    with pytest.raises(Killed):
        train_direct(_tiny_student(), _stream(), cfg, checkpoint_path=ckpt)
    monkeypatch.undo()
    assert torch.load(ckpt, weights_only=False)["data"]["position"] == 3  # the stream's place is saved
    student, resumed_stream = _tiny_student(), _stream()
    assert train_direct(student, resumed_stream, cfg, checkpoint_path=ckpt) == full
    assert resumed_stream.position == 6
    expected = full_student.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in student.state_dict().items())


def test_checkpoint_of_other_settings_is_ignored_not_resumed(tmp_path, monkeypatch):
    q, k = realistic_qk()
    cfg = LayerTrainConfig(steps=12, eval_every=4, checkpoint_every=6, warmup_steps=2)
    full = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, meta={"lr_z": 0.02})
    ckpt = tmp_path / "layer.ckpt"
    other = LayerTrainConfig(steps=12, eval_every=4, checkpoint_every=6, warmup_steps=2, lr_z=0.2)
    _kill_at(monkeypatch, "train:layer:step8")
    with pytest.raises(Killed):
        train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, other, checkpoint_path=ckpt,
                    meta={"lr_z": 0.2})
    monkeypatch.undo()
    ours = train_layer(build_feature_map("learned_prf", 3, 16, 8), q, k, cfg, checkpoint_path=ckpt,
                       meta={"lr_z": 0.02})
    assert ours.curve == full.curve  # from step 0, not from the other run's step 6
    assert all(torch.equal(full.state_dict[n], t) for n, t in ours.state_dict.items())


def test_direct_checkpoint_of_other_settings_is_ignored(tmp_path, monkeypatch):
    cfg = LayerTrainConfig(steps=6, batch_size=2, warmup_steps=2, checkpoint_every=3)
    full = train_direct(_tiny_student(), _tokens(), cfg, meta={"seed": 0})
    ckpt = tmp_path / "direct.ckpt"
    _kill_at(monkeypatch, "train:direct:step4")
    with pytest.raises(Killed):
        train_direct(_tiny_student(), _tokens(), LayerTrainConfig(steps=6, batch_size=2, warmup_steps=2,
                     checkpoint_every=3, lr_z=0.5), checkpoint_path=ckpt, meta={"lr_z": 0.5})
    monkeypatch.undo()
    assert train_direct(_tiny_student(), _tokens(), cfg, checkpoint_path=ckpt, meta={"seed": 0}) == full


def test_run_layerwise_reads_other_directories_but_writes_only_its_own(tmp_path):
    acts = {i: realistic_qk(seed=i) for i in range(2)}
    cfg = LayerTrainConfig(steps=4, eval_every=2)
    fms = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    run_layerwise(fms, acts.__getitem__, [0], cfg, tmp_path / "theirs", {"steps": 4})
    theirs = {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()}
    seen = []

    def activations(i):
        seen.append(i)
        return acts[i]

    fresh = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    run_layerwise(fresh, activations, [0, 1], cfg, tmp_path / "ours", {"steps": 4}, also_read=[tmp_path / "theirs"])
    assert seen == [1] and torch.equal(fresh[0].z, fms[0].z)  # layer 0 reused from theirs
    assert sorted(p.name for p in (tmp_path / "ours").glob("*.pt")) == ["layer_01.pt"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()} == theirs
    fresh = [build_feature_map("learned_prf", 3, 16, 8, seed=i) for i in range(2)]
    run_layerwise(fresh, activations, [0], cfg, tmp_path / "ours", {"steps": 5}, also_read=[tmp_path / "theirs"])
    assert seen == [1, 0]  # other settings: theirs is not used, and not deleted
    assert {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()} == theirs
