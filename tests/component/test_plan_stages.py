"""A mixed-head student in the pieces the stages share: a layer's groups with features as one trained unit
(:class:`~dofla.train.grouped.GroupedFeatures`: one optimiser, each group on its own heads with its own
window and sinks, its state dict the student's own modules), the window dropout acting on the groups that
keep a window before a state, and the model card describing the plan."""
from __future__ import annotations

import copy

import torch

from dofla.models import convert
from dofla.models.capture import capture_qkv
from dofla.models.card import _attention
from dofla.models.mixed_attention import hybrid_attentions
from dofla.models.plan import ALL
from dofla.stages.students import layer_features
from dofla.train import LayerTrainConfig, train_layer
from dofla.train.distill import windows_dropped
from dofla.train.layerwise import layer_loss

from .test_mixed_heads import PLAN, _perturbed, _teacher
from .test_student import _ids


def _mixed():
    return _perturbed(convert(_teacher(), feature_map="learned_prf", plan=PLAN))


def test_a_mixed_layers_groups_train_as_one_unit_on_their_own_heads():
    student = _mixed()
    layer = student.student_attentions()[0]
    grouped = layer_features(layer)
    assert grouped.slices == [([4, 5], [2], 3, 0), ([6, 7], [3], 0, 0)] and grouped.num_features == [8, 4]
    q, k, v = capture_qkv(_teacher(), _ids(batch=12, length=32, seed=4))[0]
    cfg = LayerTrainConfig(steps=20, batch_size=4, loss="output", eval_every=10, warmup_steps=2, heldout_fraction=0.25)
    # the layer's loss: each group's own loss on its heads, weighted by its heads
    parts = [layer_loss(part.feature_map, q[:4, heads], k[:4, kv], LayerTrainConfig(loss="output", window=part.window),
                        v=v[:4, kv]) for part, heads, kv in layer.trainable_parts()]
    torch.testing.assert_close(layer_loss(grouped, q[:4], k[:4], cfg, v=v[:4]), (parts[0] + parts[1]) / 2)
    before = copy.deepcopy(grouped.state_dict())
    result = train_layer(grouped, q, k, cfg, v=v)
    assert result.final_heldout_loss < 0.99 * result.initial_heldout_loss
    # the artifact's state loads into another student's layer, group by group
    other = _mixed().student_attentions()[0]
    layer_features(other).load_state_dict(result.state_dict)
    for j, g in enumerate((2, 3)):
        for name, value in other.parts[g].feature_map.state_dict().items():
            assert torch.equal(value, result.state_dict[f"parts.{j}.{name}"]), name
        assert any(not torch.equal(before[name], value) for name, value in result.state_dict.items()
                   if name.startswith(f"parts.{j}.")), f"group {g} did not train"


def test_the_window_dropout_runs_a_mixed_layers_windowed_groups_as_their_states_alone():
    student = _mixed()
    hybrid = hybrid_attentions(student)
    layers = student.student_attentions()
    assert [id(a) for a in hybrid] == [id(layers[0].parts[2]), id(layers[1].parts[1])]
    dropped = [PLAN[0][:2] + [{"state": "delta", "M": 8}, PLAN[0][3]],
               [PLAN[1][0], {"state": "additive", "M": [4, 8]}, {"window": ALL}, {"window": ALL}]]
    reference = convert(_teacher(), feature_map="learned_prf", plan=dropped)
    reference.load_state_dict(student.state_dict())
    ids = _ids(batch=2, length=20, seed=5)
    with torch.no_grad():
        before = student(ids, use_cache=False).logits
        with windows_dropped(student, [0, 1]):
            torch.testing.assert_close(student(ids, use_cache=False).logits, reference(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
        assert [(a.window, a.sinks) for a in hybrid] == [(3, 0), (4, 1)]
        torch.testing.assert_close(student(ids, use_cache=False).logits, before, rtol=0, atol=0)
        assert not torch.allclose(before, reference(ids, use_cache=False).logits, atol=1e-4)


def test_the_card_describes_a_plan_whose_heads_differ_and_words_a_uniform_one_by_its_form():
    mixed = _attention(_mixed().config.dofla)
    assert mixed.startswith("a plan per key/value head (8 heads in 2 layers): 3 exact (a key/value cache)")
    assert "a window of 3 tokens with a gated-delta state of M=8 before it" in mixed
    assert "an additive state of M=8 with a decay gate" in mixed
    uniform = convert(_teacher(), feature_map="learned_prf", attention="gated_delta", dims=[8, 8])
    assert _attention(uniform.config.dofla) == "gated delta rule (every global layer)"
    hybrid = convert(_teacher(), feature_map="learned_prf", attention="hybrid", window=4, sinks=2, dims=[8, 8])
    assert _attention(hybrid.config.dofla) == ("hybrid: exact softmax over the last 4 tokens and 2 sinks, linear "
                                               "attention before")
