"""A gated student (``gate="scalar"``, linear or hybrid) on tiny GPT-2 / GPT-NeoX / Llama: closed it is
the ungated student exactly; open it decodes like its parallel forward, pads like a lone row, saves and loads;
distillation opens it and keeps it a decay."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.errors import DoflaError
from dofla.models import RecurrentStateCache, convert, load_student
from dofla.train.direct import RandomRows
from dofla.train.distill import (DistillSchedule, attention_projections, gate_parameters, prepare_trainable,
                                 train_kl)
from tests.conftest import logits_of, token_ids


HYBRID = {"attention": "hybrid", "window": 5, "sinks": 2}


def _gated(model, seed=0, **form):
    return convert(model, feature_map="hedgehog", dims=[16, 16], chunk_size=4, gate="scalar", seed=seed, **form)


def _open(student, seed=2):
    """Give every gate a visible, data-dependent decay (α ≈ 0.3–0.8)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gate_parameters(student):
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + (0.3 if p.ndim == 1 else 0.0))
    return student


@pytest.mark.parametrize("form", [{}, HYBRID], ids=["linear", "hybrid"])
def test_a_closed_gate_is_the_ungated_student_and_an_open_one_is_not(tiny_model, form):
    ungated = convert(copy.deepcopy(tiny_model), feature_map="hedgehog", dims=[16, 16], chunk_size=4, **form)
    gated = _gated(tiny_model, **form)
    ids = token_ids()
    assert all(a.gate is not None for a in gated.student_attentions())
    assert torch.equal(logits_of(gated, ids), logits_of(ungated, ids))
    assert (logits_of(_open(gated), ids) - logits_of(ungated, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("form", [{}, HYBRID], ids=["linear", "hybrid"])
def test_an_open_gate_decodes_like_the_parallel_forward_and_saves(tiny_model, tmp_path, form):
    student = _open(_gated(tiny_model, **form))
    ids = token_ids(length=21)
    full = logits_of(student, ids)
    cache = RecurrentStateCache(2)
    with torch.no_grad():
        first = student(ids[:, :11], past_key_values=cache).logits
        rest = [student(ids[:, t:t + 1], past_key_values=cache).logits for t in range(11, 21)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-4, atol=1e-4)
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert reloaded.config.dofla["gate"] == "scalar"
    assert torch.equal(logits_of(reloaded, ids), full)
    prompt = ids[:1, :7]
    out = reloaded.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = prompt
    for _ in range(8):
        expected = torch.cat([expected, logits_of(reloaded, expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("form", [{}, HYBRID], ids=["linear", "hybrid"])
def test_a_left_padded_row_equals_the_row_alone(tiny_model, form):
    student = _open(_gated(tiny_model, **form))
    ids = token_ids(batch=1, length=15)
    pads = 4
    padded = torch.cat([torch.zeros(1, pads, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones(1, 15, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = logits_of(student, padded, attention_mask=mask, position_ids=position_ids)[:, pads:]
    torch.testing.assert_close(out, logits_of(student, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", [{}, HYBRID], ids=["linear", "hybrid"])
def test_distillation_opens_the_gate_and_keeps_it_a_decay(tiny_model, form):
    teacher = copy.deepcopy(tiny_model).eval()
    student = _gated(tiny_model, **form)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a student that differs from its teacher, so the KL has a gradient
        for p in attention_projections(student):
            if p.ndim == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    schedule = DistillSchedule(steps=8, micro_batch_size=4, lr=1e-2, feature_lr=3e-2, warmup_steps=1)
    rows = RandomRows(token_ids(batch=16, length=32), 4, seed=0)
    student, _, _ = train_kl(student, teacher, rows, ["features", "gate"], schedule)
    alphas = torch.cat([a.gate.alpha for a in student.student_attentions()])
    assert (alphas >= 0).all() and alphas.max() > 0  # opened, and still a decay (projected at 0)
    ungated = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[16, 16], chunk_size=4)
    with pytest.raises(DoflaError, match="leaves nothing to train"):
        prepare_trainable(ungated, ["gate"])


def test_a_gate_needs_a_linear_state(tiny_model):
    with pytest.raises(ValueError, match="gate='scalar' decays a linear state"):
        convert(tiny_model, feature_map="hedgehog", dims=[16, 16], attention="sliding_window", window=4, gate="scalar")
