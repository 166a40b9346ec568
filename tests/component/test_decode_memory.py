"""Decode memory per sequence, extended from two short prefills, equals what a prefill of that length holds."""
from __future__ import annotations

import pytest
import torch

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


def test_a_window_holds_each_kv_heads_keys_once():
    """Grouped-query attention (the tiny Llama: 4 query heads over 2 KV heads of dim 16): a window of 8 with 2
    sinks holds, per layer, 7 recent positions and 2 sinks of each KV head's key and value in fp32 and two
    flags per position (valid, for the window and for the sinks); nothing per query head."""
    teacher = build_tiny_model("llama", seed=0)
    config = teacher.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    assert kv_heads < config.num_attention_heads
    student = convert(teacher, attention="sliding_window", window=8, sinks=2)
    per_position = kv_heads * 2 * head_dim * 4 + 1
    assert prefill_bytes(student, 40) == config.num_hidden_layers * (7 + 2) * per_position


@pytest.mark.parametrize("form", ["hybrid", "sliding_window", "gated_delta hybrid"])
def test_a_windowed_layer_holds_what_its_form_counts(form):
    """The bytes a prefill leaves equal each layer's state_bytes (the form's count, which takes a window's keys once
    per KV head) on the tiny Llama's grouped heads, and a window's keys and values are held for its 2 KV heads."""
    options = {**FORMS.get(form, {}), **({"feature_map": "hedgehog", "attention": "gated_delta", "window": 8,
                                           "sinks": 2} if form == "gated_delta hybrid" else {})}
    student = convert(build_tiny_model("llama", seed=0), dims=[8, 8], **options)
    assert prefill_bytes(student, 40) == sum(layer.state_bytes(40) for layer in student.student_attentions())
    with torch.no_grad():
        cache = student(torch.randint(0, 200, (1, 40)), use_cache=True).past_key_values
    states = [layer.state for layer in cache.layers]
    assert len(states) == 2 and all(state.k.shape[1] == 2 for state in states)
