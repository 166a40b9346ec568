"""Decode memory per sequence, extended from two short prefills, equals what a prefill of that length holds."""
from __future__ import annotations

import pytest

from dofla import convert
from dofla.eval.memory import decode_bytes, prefill_bytes
from dofla.models.tiny import build_tiny_model

FORMS = {  # convert() keyword arguments of each form
    "linear": dict(feature_map="hedgehog"),
    "hybrid": dict(feature_map="hedgehog", attention="hybrid", window=8, sinks=2),
    "sliding_window": dict(attention="sliding_window", window=8, sinks=2),
    "gated_delta": dict(feature_map="hedgehog", attention="gated_delta"),
    "one layer exact": dict(feature_map="hedgehog", softmax_layers=[1]),
}


@pytest.fixture(scope="module")
def teacher():
    return build_tiny_model("llama", seed=0)


@pytest.mark.parametrize("form", list(FORMS))
def test_extended_bytes_are_a_long_prefills_bytes(form):
    student = convert(build_tiny_model("llama", seed=0), dims=[8, 8], **FORMS[form])
    assert decode_bytes(student, [61])[61] == prefill_bytes(student, 61)
    short, long = decode_bytes(student, [40, 120]).values()
    assert (short < long) == (form == "one layer exact")  # only a layer kept exact grows


def test_the_teacher_and_an_exact_layer_grow_with_the_context(teacher):
    grow = decode_bytes(teacher, [40, 80])
    assert grow[80] == prefill_bytes(teacher, 80) and grow[80] > grow[40]
