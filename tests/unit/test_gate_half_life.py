"""studies/gate_half_life.py: what a gated student's gates learned, read from a real forward."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from studies.gate_half_life import gate_statistics, table


def _student(gate="scalar", **form):
    return convert(build_tiny_model("llama", seed=0), feature_map="hedgehog", dims=[16, 16], chunk_size=4, gate=gate,
                   **form)


def test_a_closed_gate_never_forgets_and_an_open_one_has_the_half_life_of_its_decay():
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    closed = gate_statistics(_student(), tokens)
    assert [r["layer"] for r in closed] == [0, 1]
    assert all(r["decay"] == 0 and all(h == math.inf for h in r["half_lives"]) for r in closed)
    student = _student()
    with torch.no_grad():  # a constant decay: w = 0, so a = −α·softplus(b) on every token
        for gate in (a.gate for a in student.student_attentions()):
            gate.weight.zero_()
            gate.bias.fill_(0.5)
            gate.alpha.copy_(torch.linspace(0.01, 0.1, gate.alpha.numel()))
    rows = gate_statistics(student, tokens)
    softplus = math.log1p(math.exp(0.5))
    for alpha, life in zip(torch.linspace(0.01, 0.1, len(rows[0]["half_lives"])).tolist(), rows[0]["half_lives"]):
        assert life == pytest.approx(math.log(2) / (alpha * softplus), rel=1e-5)
    assert rows[0]["alpha"][0] == pytest.approx(0.01) and rows[0]["alpha"][2] == pytest.approx(0.1)
    lines = table(rows).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 0 | 0.0100 / ")


def test_an_ungated_student_is_refused_in_one_sentence():
    with pytest.raises(SystemExit, match="no decay gate"):
        gate_statistics(_student("none"), torch.zeros(1, 8, dtype=torch.long))


def test_a_learned_linear_scale_gets_its_column():
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    student = _student(attention="hybrid", window=4, linear_scale="learned")
    with torch.no_grad():
        for attention in student.student_attentions():
            attention.linear_log_scale.copy_(torch.tensor([-2.0, -1.0, 0.5, 1.5]))
    rows = gate_statistics(student, tokens)
    assert rows[0]["scale"] == pytest.approx((-2.0, -1.0, 1.5))  # min, median (lower middle), max
    lines = table(rows).splitlines()
    assert lines[0].endswith("linear scale β min / median / max |") and lines[2].endswith("| -2.00 / -1.00 / +1.50 |")
    assert "linear scale" not in table(gate_statistics(_student(), tokens))
