"""A hybrid student's learned linear scale (``linear_scale="learned"``): a per-head weight e^β of the linear part
against the exact window. At β = 0 it is the fixed student exactly; at β → −∞ the linear part is gone and the layer
is window + sinks; each head reads its own β (head blocks too); it decodes like its parallel forward, saves and
loads; distillation trains it with the features; a restored softmax layer drops it."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.attention.sliding import sliding_window_chunked
from dofla.feature_maps.blocks import build_layer_feature_map
from dofla.models import RecurrentStateCache, convert, load_student
from dofla.models.restore import restore_softmax
from dofla.models.student_attention import StudentAttention
from dofla.train.direct import RandomRows
from dofla.train.distill import DistillSchedule, attention_projections, train_kl
from tests.conftest import logits_of, token_ids

HYBRID = {"attention": "hybrid", "window": 5, "sinks": 2}
OFF = -200.0  # e^−200: nothing the linear part adds survives next to the window's exact mass


def _student(model, scale="learned", **form):
    return convert(copy.deepcopy(model), feature_map="hedgehog", dims=[16, 16], chunk_size=4, linear_scale=scale,
                   **{**HYBRID, **form})


def _scales(student):
    return [a.linear_log_scale for a in student.student_attentions()]


def _set(student, value=None, seed=3):
    """Every β to ``value``, or (None) to seeded values in [−1.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for beta in _scales(student):
            beta.copy_(torch.full_like(beta, value) if value is not None else torch.rand(beta.shape, generator=g) * 3 - 1.5)
    return student


def test_zero_is_the_fixed_student_and_a_very_negative_scale_is_window_and_sinks(tiny_model):
    fixed, learned = _student(tiny_model, "fixed"), _student(tiny_model)
    ids = token_ids()
    assert all(b is None for b in _scales(fixed)) and all(b.shape == (4,) for b in _scales(learned))
    assert torch.equal(logits_of(learned, ids), logits_of(fixed, ids))
    assert (logits_of(_set(learned), ids) - logits_of(fixed, ids)).abs().max() > 1e-3
    window = convert(copy.deepcopy(tiny_model), chunk_size=4, attention="sliding_window", window=5, sinks=2)
    torch.testing.assert_close(logits_of(_set(learned, OFF), ids), logits_of(window, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", [16, [8, 16, 8, 16]], ids=["one block", "head blocks"])
def test_each_head_reads_its_own_scale(dims):
    torch.manual_seed(0)
    attn = StudentAttention(4, 4, 16, build_layer_feature_map("hedgehog", 4, 16, dims), chunk_size=4, window=5,
                            sinks=2, learned_scale=True)
    q, k, v = (torch.randn(2, 4, 23, 16) for _ in range(3))
    with torch.no_grad():
        unscaled = attn(q, k, v)[0]
        attn.linear_log_scale.copy_(torch.tensor([0.0, OFF, 0.0, 0.0]))
        out = attn(q, k, v)[0]
    exact = sliding_window_chunked(q, k, v, 5, 2, 4)[0]
    torch.testing.assert_close(out[:, 1], exact[:, 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, [0, 2, 3]], unscaled[:, [0, 2, 3]], rtol=0, atol=0)
    assert (unscaled[:, 1] - exact[:, 1]).abs().max() > 1e-3  # the linear part did count before


def test_a_scaled_student_decodes_like_its_parallel_forward_saves_and_loads(tiny_model, tmp_path):
    student = _set(_student(tiny_model))
    ids = token_ids(length=21)
    full = logits_of(student, ids)
    cache = RecurrentStateCache(2)
    with torch.no_grad():
        first = student(ids[:, :11], past_key_values=cache).logits
        rest = [student(ids[:, t:t + 1], past_key_values=cache).logits for t in range(11, 21)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-4, atol=1e-4)
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert reloaded.config.dofla["linear_scale"] == "learned"
    for mine, theirs in zip(_scales(student), _scales(reloaded)):
        assert torch.equal(mine, theirs)
    assert torch.equal(logits_of(reloaded, ids), full)


@pytest.mark.parametrize("arch", ["llama"])  # one family is enough: the trainer does not look at it
def test_distillation_trains_the_scale_with_the_features_only(tiny_model):
    teacher = copy.deepcopy(tiny_model).eval()
    schedule = DistillSchedule(steps=6, micro_batch_size=4, lr=1e-2, feature_lr=3e-2, warmup_steps=1)
    moved = {}
    for train in (["features"], ["attention"]):
        student = _student(tiny_model)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # a student that differs from its teacher, so the KL has a gradient
            for p in attention_projections(student):
                if p.ndim == 2:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        student, _, _ = train_kl(student, teacher, RandomRows(token_ids(batch=16, length=32), 4, seed=0), train, schedule)
        moved[train[0]] = torch.cat(_scales(student)).abs().max().item()
    assert moved["features"] > 1e-3 and moved["attention"] == 0.0


def test_a_restored_softmax_layer_drops_its_scale_and_the_student_reloads(tiny_model, tmp_path):
    student = restore_softmax(_set(_student(tiny_model)), [0])
    assert _scales(student)[0] is None and _scales(student)[1] is not None
    ids = token_ids()
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert _scales(reloaded)[0] is None and torch.equal(_scales(reloaded)[1], _scales(student)[1])
    assert torch.equal(logits_of(reloaded, ids), logits_of(student, ids))


@pytest.mark.parametrize("form", [{"attention": "linear", "window": 0, "sinks": 0},
                                  {"attention": "sliding_window"}], ids=["linear", "sliding_window"])
def test_a_learned_scale_needs_a_hybrid(tiny_model, form):
    with pytest.raises(ValueError, match="linear_scale='learned'"):
        _student(tiny_model, **form)
