"""``studies/topk_kl.py`` on a tiny model: the top-k KL against the exact one, and its gradients'."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train import prepare_trainable
from studies.topk_kl import compare


def test_the_shortfall_and_gradient_errors_vanish_as_k_covers_the_vocabulary():
    teacher = build_tiny_model("llama", seed=0).eval()
    student = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[8, 8])
    with torch.no_grad():  # a student some way from its teacher, so the KL is far above rounding
        for p in student.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model, groups = prepare_trainable(student, ["features", "attention"])
    params = [p for _, ps in groups for p in ps]
    vocab = teacher.config.vocab_size
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    rows = compare(model, params, teacher, ids, [4, 32, vocab - 1])
    assert rows[0]["k"] == "exact" and rows[0]["kl"] > 0
    shortfalls = [r["shortfall"] for r in rows[1:]]
    assert all(s >= -1e-6 for s in shortfalls) and shortfalls[0] > shortfalls[1]  # a lower bound, tighter with k
    assert shortfalls[-1] == pytest.approx(0.0, abs=1e-5)  # k = V − 1: the rest is one token, the KL exact
    for r in rows[1:]:
        assert -1 <= r["logits_cos"] <= 1 and -1 <= r["params_cos"] <= 1
    assert rows[-1]["logits_err"] < 1e-4 and rows[-1]["params_err"] < 1e-4
