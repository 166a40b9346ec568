"""Window dropout in distillation (``distill.window_dropout``): a hybrid layer without its window is
exactly the linear layer with the same features, training with the window always dropped is training
the linear student, the draw depends on (seed, step) alone, and a resumed run ends where an
uninterrupted one does."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train.direct import RandomRows
from dofla.train.distill import (DistillSchedule, dropped_windows, train_kl, window_dropout_rate,
                                 windows_dropped)

SCHEDULE = DistillSchedule(steps=6, micro_batch_size=2, lr=1e-2, feature_lr=1e-2, warmup_steps=1,
                           log_every=2, checkpoint_every=2)
TRAIN = ["features", "attention"]


def tokens(rows=12, length=24, seed=0):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def students(arch="llama"):
    """A tiny teacher, its hybrid student (window 4, 2 sinks) and the linear student with the same
    feature maps."""
    teacher = build_tiny_model(arch, seed=0).eval()
    hybrid = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[16, 16], window=4, sinks=2,
                     attention="hybrid", chunk_size=4).eval()
    linear = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[16, 16], chunk_size=4).eval()
    for h, lin in zip(hybrid.student_attentions(), linear.student_attentions()):
        lin.feature_map.load_state_dict(h.feature_map.state_dict())
    return teacher, hybrid, linear


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_dropped_window_runs_the_layer_as_the_linear_layer(arch):
    _, hybrid, linear = students(arch)
    ids = tokens(rows=2)
    before = logits(hybrid, ids)
    assert not torch.allclose(before, logits(linear, ids), atol=1e-3)  # the window matters here
    with windows_dropped(hybrid, [0, 1]) as chosen:
        assert [attn.mode for attn in chosen] == ["linear", "linear"]
        torch.testing.assert_close(logits(hybrid, ids), logits(linear, ids), rtol=1e-4, atol=1e-4)
    assert [(a.window, a.sinks, a.mode) for a in hybrid.student_attentions()] == [(4, 2, "hybrid")] * 2
    torch.testing.assert_close(logits(hybrid, ids), before)
    with windows_dropped(hybrid, [1]):  # one layer: neither the hybrid nor the linear student
        one = logits(hybrid, ids)
    assert not torch.allclose(one, before, atol=1e-4) and not torch.allclose(one, logits(linear, ids), atol=1e-4)


def test_always_dropping_the_window_trains_the_linear_student():
    teacher, hybrid, linear = students()
    always = dataclasses.replace(SCHEDULE, window_dropout=1.0)
    dropped, _, _ = train_kl(copy.deepcopy(hybrid), teacher, RandomRows(tokens(), 4, seed=0), TRAIN, always)
    plain, _, _ = train_kl(linear, teacher, RandomRows(tokens(), 4, seed=0), TRAIN, SCHEDULE)
    kept, _, _ = train_kl(hybrid, teacher, RandomRows(tokens(), 4, seed=0), TRAIN, SCHEDULE)
    assert all(a.mode == "hybrid" for a in dropped.student_attentions())  # windows back after training
    changed = False
    for (name, a), b, c in zip(dropped.state_dict().items(), plain.state_dict().values(), kept.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        changed |= not torch.allclose(a, c, atol=1e-5)
    assert changed  # with the window kept, the same steps train something else


def test_the_rate_moves_linearly_and_the_draw_depends_on_seed_and_step_alone():
    s = dataclasses.replace(SCHEDULE, steps=11, window_dropout=0.9, window_dropout_end=0.5)
    assert [round(window_dropout_rate(i, s), 6) for i in (0, 5, 10)] == [0.9, 0.7, 0.5]
    assert window_dropout_rate(7, dataclasses.replace(s, window_dropout_end=None)) == 0.9
    assert dropped_windows(30, 3, dataclasses.replace(s, window_dropout=0.0, window_dropout_end=None)) == []
    assert dropped_windows(30, 3, dataclasses.replace(s, window_dropout_end=1.0, steps=4)) == list(range(30))
    assert dropped_windows(30, 4, s) == dropped_windows(30, 4, s)
    assert dropped_windows(30, 4, s) != dropped_windows(30, 4, dataclasses.replace(s, seed=1))
    half = dataclasses.replace(s, steps=400, window_dropout=0.3, window_dropout_end=None)
    share = sum(len(dropped_windows(10, i, half)) for i in range(400)) / 4000
    assert 0.27 < share < 0.33


class Crash(RuntimeError):
    pass


class CrashingRows(RandomRows):
    def __init__(self, *args, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.served, self.at = 0, at

    def next_batch(self):
        if self.served == self.at:
            raise Crash
        self.served += 1
        return super().next_batch()


def test_a_resumed_run_draws_the_same_windows(tmp_path):
    teacher, hybrid, _ = students()
    s = dataclasses.replace(SCHEDULE, window_dropout=0.9, window_dropout_end=0.4)
    reference, _, _ = train_kl(copy.deepcopy(hybrid), teacher, RandomRows(tokens(), 4, seed=0), TRAIN, s)
    ckpt = tmp_path / "distill_ckpt.pt"
    with pytest.raises(Crash):
        train_kl(copy.deepcopy(hybrid), teacher, CrashingRows(tokens(), 4, seed=0, at=5), TRAIN, s,
                 checkpoint_path=ckpt, meta={"run": "a"})
    resumed, _, _ = train_kl(hybrid, teacher, RandomRows(tokens(), 4, seed=0), TRAIN, s, checkpoint_path=ckpt,
                             meta={"run": "a"})
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
