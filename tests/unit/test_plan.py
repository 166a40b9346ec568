"""The per-head plan: what today's settings expand into, its checks, its files and its bytes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dofla.models import ConversionSpec
from dofla.models.plan import ALL, HeadPlan, StudentPlan, check_plan, expand, group_indices, read_plan

GEOMETRY = SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, layer_windows=None)


def _plan(**settings) -> StudentPlan:
    return expand(ConversionSpec(**{"dims": [8, 4, 8], **settings}), GEOMETRY)


def test_linear_dims_give_every_kv_head_an_additive_state_of_its_layers_dim():
    plan = _plan()
    assert plan.layers[1] == (HeadPlan(state="additive", M=4),) * 2
    assert plan.dims(group=2) == [8, 4, 8]


def test_per_head_dims_go_to_the_kv_head_their_query_heads_read():
    plan = _plan(dims=[[4, 8, 12, 12], 8, 8])
    assert [h.M for h in plan.layers[0]] == [(4, 8), (12, 12)]
    assert plan.dims(group=2) == [[4, 8, 12, 12], 8, 8]
    assert group_indices(plan.layers[0]) == [[0, 1]]  # one structure: one kernel call, dims in blocks


def test_the_shorthands_expand_head_by_head():
    hybrid = _plan(attention="hybrid", window=16, sinks=2, gate="scalar", linear_scale="learned", softmax_layers=[2])
    assert hybrid.layers[0][0] == HeadPlan(16, 2, "additive", 8, "scalar", "learned")
    assert hybrid.layers[2] == (HeadPlan(window=ALL),) * 2
    assert _plan(attention="sliding_window", window=4, sinks=1).layers[1][1] == HeadPlan(window=4, sinks=1)
    assert _plan(attention="gated_delta", window=4).layers[0][1] == HeadPlan(window=4, state="delta", M=8)
    assert _plan(feature_map="softmax").layers[1] == (HeadPlan(window=ALL),) * 2
    local = SimpleNamespace(**{**vars(GEOMETRY), "layer_windows": [16, None, 16]})
    assert [layer[0] for layer in expand(ConversionSpec([8, 8, 8], softmax_layers=[0]), local).layers] == [
        HeadPlan(window=16), HeadPlan(state="additive", M=8), HeadPlan(window=16)]


def test_heads_share_a_call_when_only_an_additive_states_dims_differ():
    layer = (HeadPlan(state="additive", M=4), HeadPlan(state="additive", M=8), HeadPlan(state="delta", M=4),
             HeadPlan(state="delta", M=8), HeadPlan(state="delta", M=4), HeadPlan(window=ALL))
    assert group_indices(layer) == [[0, 1], [2, 4], [3], [5]]


def test_a_plan_round_trips_through_its_saved_form():
    plan = StudentPlan([(HeadPlan(window=ALL), HeadPlan(4, 1, "additive", (4, 8), "scalar"))] * 3)
    assert StudentPlan.from_list(plan.to_list()) == plan
    assert plan.to_list()[0][1]["M"] == [4, 8]


def test_bytes_count_each_head_as_its_form_does():
    exact = StudentPlan([(HeadPlan(window=ALL),) * 2] * 3)
    assert exact.state_bytes(group=2, head_dim=8, tokens=100) == 3 * 2 * 2 * 100 * 8 * 4  # K and V per KV head
    linear = _plan()
    assert linear.state_bytes(2, 8, 10) == linear.state_bytes(2, 8, 10_000) == (8 + 4 + 8) * 4 * (8 + 2) * 4


@pytest.mark.parametrize("text, suffix", [('[[{"window": "all"}, {"state": "additive", "M": 8}]]', ".json"),
                                          ("layers:\n  - [{window: all}, {state: additive, M: 8}]\n", ".yaml")])
def test_a_plan_file_is_read_as_json_or_yaml(tmp_path, text, suffix):
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    assert read_plan(path).layers == [(HeadPlan(window=ALL), HeadPlan(state="additive", M=8))]


@pytest.mark.parametrize("text, sentence", [("{}", "holds no list of layers"),
                                            ('[[{"window": 4, "span": 2}]]', "a field that is not one of")])
def test_a_wrong_plan_file_is_one_sentence(tmp_path, text, sentence):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=sentence):
        read_plan(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_plan(tmp_path / "missing.json")


def test_a_plan_is_checked_head_by_head():
    plan = StudentPlan([(HeadPlan(window=ALL), HeadPlan(state="nope", M=8))] * 3)
    with pytest.raises(ValueError, match="layer 0 head 1: state='nope' is not one of none, additive, delta"):
        check_plan(plan, GEOMETRY)


def test_a_named_form_must_keep_the_heads_state_and_window():
    plan = StudentPlan([(HeadPlan(window=4, state="additive", M=8, form="sliding_window"),) * 2] * 3)
    with pytest.raises(ValueError, match="form='sliding_window' keeps a 'none' state with window required"):
        check_plan(plan, GEOMETRY)
    named = HeadPlan(window=4, state="additive", M=8, form="hybrid")
    assert named.attention_form.name == "hybrid" and "form" not in HeadPlan(window=4).to_dict()
