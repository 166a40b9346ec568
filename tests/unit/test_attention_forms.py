"""The registry of attention forms: its names, how a layer's state and window pick a form, and each
form's settings checks."""
from __future__ import annotations

import pytest

from dofla.attention import ATTENTION_FORMS, FORMS, form_for, get_form
from dofla.models import ConversionSpec


def test_the_config_names_are_the_selectable_forms():
    assert ATTENTION_FORMS == ("linear", "hybrid", "sliding_window", "gated_delta")
    assert set(FORMS) == {*ATTENTION_FORMS, "softmax"}
    assert not get_form("softmax").selectable and not get_form("sliding_window").traits.trains


@pytest.mark.parametrize("state, window, name", [
    ("kv", 0, "softmax"), ("none", 4, "sliding_window"), ("additive", 0, "linear"), ("additive", 4, "hybrid"),
    ("delta", 0, "gated_delta"), ("delta", 4, "gated_delta")])
def test_a_state_and_a_window_pick_one_form(state, window, name):
    assert form_for(state, window).name == name


def test_no_form_keeps_a_window_alone_without_one():
    with pytest.raises(ValueError, match="no attention form keeps a 'none' state with window 0"):
        form_for("none", 0)


@pytest.mark.parametrize("settings, sentence", [
    (dict(attention="nope"), "is not one of linear, hybrid, sliding_window, gated_delta"),
    (dict(attention="hybrid"), "needs window ≥ 1"),
    (dict(attention="sliding_window", window=4, gate="scalar"), "decays a linear state"),
    (dict(attention="linear", sinks=2), "sinks=2 needs to be ≥ 0, and > 0 only with hybrid"),
    (dict(attention="linear", linear_scale="learned"), "learned only with hybrid attention"),
    (dict(attention="gated_delta", gate="scalar"), "has its own decay and output gates"),
    (dict(attention="gated_delta", dims=[[4, 8]]), "takes one feature dimension per layer"),
    (dict(attention="gated_delta", sinks=1), "needs window ≥ 1 with attention='gated_delta'"),
])
def test_each_user_error_is_one_sentence(settings, sentence):
    with pytest.raises(ValueError, match=sentence):
        ConversionSpec(**{"dims": [8], **settings})
