"""studies/hybrid_layer_gain.py: one layer's linear part at a time."""
from __future__ import annotations

import pytest
import torch

from studies.hybrid_layer_gain import layer_gains, only_layer, table
from dofla.eval import heldout_loss
from dofla.models import convert
from dofla.models.tiny import build_tiny_model


@pytest.fixture
def student():
    return convert(build_tiny_model("llama", seed=0, num_layers=3), dims=[6, 4, 8], window=4, sinks=1,
                   attention="hybrid", chunk_size=4)


def test_only_layer_keeps_one_linear_part_and_restores_all(student):
    maps = [a.feature_map for a in student.student_attentions()]
    with only_layer(student, 1):
        assert [a.feature_map is not None for a in student.student_attentions()] == [False, True, False]
    assert all(a.feature_map is m for a, m in zip(student.student_attentions(), maps))


def test_layer_gains_bracket_the_full_and_window_students(student):
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    result = layer_gains(student, tokens)
    assert result["full"] == pytest.approx(heldout_loss(student, tokens))
    assert sorted(result["layers"]) == [0, 1, 2]
    # every single-layer student differs from both ends (the tiny model's linear parts do matter)
    assert all(loss not in (result["full"], result["window"]) for loss in result["layers"].values())
    text = table(result)
    assert text.count("\n| ") == 3 and "sum of the per-layer gains" in text
