"""Students saved by an earlier release (tests/fixtures/students, one per attention form and per setting that
changes a layer) load unchanged and give the logits and the greedy continuation they gave when saved."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from dofla.attention import FORMS, AttentionForm, get_form, register
from dofla.attention.naive import linear_attention_naive
from dofla.eval.memory import prefill_bytes
from dofla.models import ConversionSpec, convert, get_adapter, load_student
from dofla.models.plan import expand
from tests.fixtures.students.write_students import teacher

FIXTURES = Path(__file__).parents[1] / "fixtures" / "students"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.pt").exists())


def test_every_form_has_a_fixture():
    assert {"linear", "hybrid", "sliding_window", "gated_delta", "gated_delta_window", "softmax"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_saved_student_loads_with_its_logits(name):
    student = load_student(FIXTURES / name)
    expected = torch.load(FIXTURES / name / "expected.pt")
    with torch.no_grad():
        logits = student(expected["ids"], use_cache=False).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=2e-5)
    tokens = student.generate(expected["ids"][:1, :9], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=256)
    assert torch.equal(tokens, expected["generated"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", [3, 9, 20])
def test_each_form_predicts_the_decode_bytes_it_holds(name, tokens):
    """The forms' state_bytes, summed over the layers, equal the bytes the cache holds after a prefill."""
    student = load_student(FIXTURES / name)
    predicted = sum(attn.state_bytes(tokens) for attn in student.student_attentions())
    assert prefill_bytes(student, tokens) == predicted


@pytest.mark.parametrize("name", NAMES)
def test_the_plan_its_settings_expand_into_builds_the_same_student(name):
    """A spec without a plan (saved before it) and the same spec with its expanded plan give the same logits,
    and the plan predicts the bytes the student holds."""
    student = load_student(FIXTURES / name)
    geometry = get_adapter(student).geometry(student.config)
    spec = ConversionSpec(**student.config.dofla)
    assert spec.plan is None
    plan = expand(spec, geometry)
    config = copy.deepcopy(student.config)
    config.dofla = {**student.config.dofla, "plan": plan.to_list()}
    planned = type(student)(config).eval()
    planned.load_state_dict(student.state_dict())
    ids = torch.load(FIXTURES / name / "expected.pt")["ids"]
    with torch.no_grad():
        torch.testing.assert_close(planned(ids, use_cache=False).logits, student(ids, use_cache=False).logits,
                                   rtol=0, atol=0)
    group = geometry.num_heads // geometry.num_kv_heads
    assert plan.state_bytes(group, geometry.head_dim, 20) == prefill_bytes(student, 20)


class QuadraticLinear(AttentionForm):
    """A form added as development.md's recipe adds one (no other file changes): linear attention by its
    quadratic reference, sharing the linear form's traits."""

    name = "quadratic_linear"
    traits = get_form("linear").traits

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        group = layer.num_heads // layer.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return linear_attention_naive(layer.feature_map.log_features(q), layer.feature_map.log_features(k), v,
                                      key_valid=key_valid), None

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        return 0


def test_a_registered_form_converts_and_runs_where_the_named_one_does():
    register(QuadraticLinear)
    try:
        ids = torch.load(FIXTURES / "linear" / "expected.pt")["ids"]
        students = {name: convert(teacher(), feature_map="learned_prf", dims=[8, 4], attention=name)
                    for name in ("linear", "quadratic_linear")}
        assert {a.form.name for a in students["quadratic_linear"].student_attentions()} == {"quadratic_linear"}
        assert students["quadratic_linear"].config.dofla["plan"][0][0]["form"] == "quadratic_linear"
        with torch.no_grad():
            logits = {name: s(ids, use_cache=False).logits for name, s in students.items()}
        torch.testing.assert_close(logits["quadratic_linear"], logits["linear"], rtol=1e-4, atol=1e-4)
    finally:
        FORMS.pop("quadratic_linear")

