"""A layer whose KV heads take different forms (exact, a window with sinks, a window with a delta state, a
pure delta state, an additive state with per-head dims): one kernel call per distinct head structure,
decoding with the cache equal to the full forward, decode bytes equal to the plan's, saved and loaded as
itself, and gradients reaching every group's parameters."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dofla.eval.memory import prefill_bytes
from dofla.models import ConversionSpec, RecurrentStateCache, StudentAttention, convert, get_adapter, load_student
from dofla.models.layers import _layer_attention, checked_plan_file
from dofla.models.mixed_attention import MixedAttention
from dofla.models.plan import ALL, HeadPlan, StudentPlan
from dofla.models.capture import capture_qkv
from dofla.train import LayerTrainConfig, train_layer
from dofla.train.distill import kl_to_teacher
from dofla.train.trainable import prepare_trainable

from .test_student import _greedy_by_parallel_forward, _ids

D = 8
PLAN = [
    [{"window": ALL}, {"window": 4, "sinks": 2}, {"window": 3, "state": "delta", "M": 8}, {"state": "delta", "M": 4}],
    [{"state": "additive", "M": 8, "gate": "scalar"}, {"window": 4, "sinks": 1, "state": "additive", "M": [4, 8]},
     {"window": ALL}, {"window": ALL}],
]


def _config() -> LlamaConfig:
    """A tiny Llama with four KV heads (two query heads each), so one layer can hold four forms."""
    return LlamaConfig(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=D, intermediate_size=64, max_position_embeddings=256,
                       tie_word_embeddings=True, bos_token_id=256, eos_token_id=256)


def _teacher(seed: int = 0) -> LlamaForCausalLM:
    config = _config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _perturbed(student):
    """Every student parameter moved off its start (the gates start where a wrong wiring hides)."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in student.parameters():
            if p.requires_grad and any(p is q for attn in student.student_attentions() for q in attn.parameters()):
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
    return student


@pytest.fixture(scope="module")
def mixed():
    return _perturbed(convert(_teacher(), feature_map="learned_prf", plan=PLAN))


def test_each_distinct_head_structure_is_one_group(mixed):
    layers = mixed.student_attentions()
    assert all(isinstance(layer, MixedAttention) for layer in layers)
    assert [layer.groups for layer in layers] == [[[0], [1], [2], [3]], [[0], [1], [2, 3]]]
    assert [[p.mode for p in layer.parts] for layer in layers] == [
        ["softmax", "sliding_window", "hybrid", "gated_delta"], ["linear", "hybrid", "softmax"]]
    assert mixed.config.dofla["plan"][1][1]["M"] == [4, 8]


def test_its_heads_compute_what_a_layer_of_their_form_computes():
    """Exact and sliding heads have no parameters: the mixed layer's heads equal the uniform layers' heads."""
    heads = [HeadPlan(window=ALL), HeadPlan(window=4, sinks=2)] * 2
    teacher = _teacher()
    geometry = get_adapter(teacher).geometry(teacher.config)
    layer = _layer_attention(ConversionSpec([D] * 2), geometry, 0, tuple(heads))
    q, k, v = (torch.randn(2, h, 19, D, generator=torch.Generator().manual_seed(h)) for h in (8, 4, 5))
    v = v[:, :4]
    out, _ = layer(q, k, v)
    exact, _ = StudentAttention(8, 4, D, None)(q, k, v)
    sliding, _ = StudentAttention(8, 4, D, None, chunk_size=128, window=4, sinks=2)(q, k, v)
    for kv, reference in ((0, exact), (1, sliding), (2, exact), (3, sliding)):
        torch.testing.assert_close(out[:, 2 * kv:2 * kv + 2], reference[:, 2 * kv:2 * kv + 2], rtol=1e-5, atol=1e-5)


def test_decoding_with_the_cache_equals_the_full_forward(mixed):
    prompt = _ids(batch=1, length=9)
    generated = mixed.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=256)
    assert torch.equal(generated, _greedy_by_parallel_forward(mixed, prompt, 12))
    ids = _ids(batch=2, length=21, seed=2)
    with torch.no_grad():
        full = mixed(ids, use_cache=False).logits
        cache = RecurrentStateCache(2)
        steps = [mixed(ids[:, :13], past_key_values=cache, use_cache=True).logits]
        steps += [mixed(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(13, 21)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_a_left_padded_batch_generates_each_row_as_alone(mixed):
    rows = [_ids(batch=1, length=11, seed=6)[0], _ids(batch=1, length=5, seed=7)[0]]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), 256), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=256)
    batched = mixed.generate(ids, attention_mask=mask, **options)
    for i, row in enumerate(rows):
        assert torch.equal(batched[i, width - len(row):], mixed.generate(row[None], **options)[0]), f"row {i}"


@pytest.mark.parametrize("tokens", [2, 7, 30])
def test_its_decode_bytes_are_the_plans(mixed, tokens):
    plan = StudentPlan.from_list(mixed.config.dofla["plan"])
    assert prefill_bytes(mixed, tokens) == plan.state_bytes(group=2, head_dim=D, tokens=tokens)
    assert prefill_bytes(mixed, tokens) == sum(layer.state_bytes(tokens) for layer in mixed.student_attentions())


def test_it_saves_and_loads_as_itself(mixed, tmp_path):
    mixed.save_pretrained(tmp_path)
    loaded = load_student(tmp_path)
    assert loaded.config.dofla["plan"] == mixed.config.dofla["plan"]
    ids = _ids(batch=2, length=17)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, mixed(ids, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_kl_distillation_trains_every_group():
    """distill=kl's trainable choice (features, gates) holds every group's parameters, and Adam steps on the KL
    to the teacher lower it and move each of them."""
    teacher = _teacher()
    student = _perturbed(convert(_teacher(), feature_map="learned_prf",
                                 plan=[PLAN[0], [PLAN[1][0], {**PLAN[1][1], "scale": "learned"}, *PLAN[1][2:]]]))
    model, groups = prepare_trainable(student, ["features", "gate"])
    trained = [p for _, params in groups for p in params]
    every = [p for layer in student.student_attentions() for part in layer.parts for p in part.parameters()]
    assert {id(p) for p in trained} == {id(p) for p in every} and len(every) > 10
    scale, gate = student.student_attentions()[1].parts[1].linear_log_scale, student.student_attentions()[1].parts[0].gate
    assert scale is not None and gate is not None and {id(scale), id(gate.alpha)} <= {id(p) for p in trained}
    before = [p.detach().clone() for p in trained]
    optimizer = torch.optim.Adam(trained, lr=1e-2)
    ids = _ids(batch=2, length=24, seed=9)
    with torch.no_grad():
        target = teacher(ids).logits
    losses = []
    for _ in range(8):
        loss = kl_to_teacher(model(ids, use_cache=False).logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, b) for p, b in zip(trained, before))


def test_each_group_with_features_trains_layerwise_on_its_heads_activations(mixed):
    """The layerwise trainer on each group's slice of the teacher's own activations, with its window and sinks."""
    q, k, v = capture_qkv(_teacher(), _ids(batch=12, length=32, seed=4))[0]
    parts = mixed.student_attentions()[0].trainable_parts()
    assert [(part.mode, heads, kv) for part, heads, kv in parts] == [("hybrid", [4, 5], [2]), ("gated_delta", [6, 7], [3])]
    for part, heads, kv in parts:
        cfg = LayerTrainConfig(steps=20, batch_size=4, loss="output", eval_every=10, warmup_steps=2,
                               window=part.window, sinks=part.sinks, heldout_fraction=0.25)
        result = train_layer(part.feature_map, q[:, heads], k[:, kv], cfg, v=v[:, kv])
        assert result.final_heldout_loss < 0.99 * result.initial_heldout_loss


def test_a_plan_file_converts_as_the_same_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("layers:\n" + "".join(f"  - {json.dumps(layer)}\n" for layer in PLAN))
    from_file = convert(_teacher(), feature_map="learned_prf", plan=path)
    assert from_file.config.dofla["plan"] == convert(_teacher(), feature_map="learned_prf", plan=PLAN).config.dofla["plan"]


@pytest.mark.parametrize("plan, sentence", [
    (PLAN[:1], "the plan has 1 layers but the model has 2"),
    ([PLAN[0][:3], PLAN[1]], "layer 0 of the plan has 3 heads but the model has 4 key/value heads"),
    ([[{"window": ALL, "state": "delta", "M": 8}] + PLAN[0][1:], PLAN[1]], "takes no state or sinks"),
    ([[{"window": 0}] + PLAN[0][1:], PLAN[1]], "attends to nothing"),
    ([[{"state": "delta", "M": [4, 8]}] + PLAN[0][1:], PLAN[1]], "takes one feature dimension per layer"),
    ([[{"state": "additive", "M": [4, 8, 8]}] + PLAN[0][1:], PLAN[1]], "one per query head of its group"),
    ([[{"window": 4, "gate": "scalar"}] + PLAN[0][1:], PLAN[1]], "decays a linear state"),
])
def test_a_wrong_plan_is_one_sentence(plan, sentence):
    with pytest.raises(ValueError, match=sentence):
        convert(_teacher(), plan=plan)


def test_a_plan_file_is_checked_against_the_teachers_config_alone(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    assert checked_plan_file(path, _config()).to_list() == StudentPlan.from_list(PLAN).to_list()
    path.write_text(json.dumps(PLAN[:1]))
    with pytest.raises(ValueError, match="the plan has 1 layers but the model has 2"):
        checked_plan_file(path, _config())


def test_a_plan_with_the_settings_it_replaces_is_refused():
    with pytest.raises(ValueError, match="a plan given whole sets every head's window.*drop window, attention"):
        convert(_teacher(), plan=PLAN, attention="hybrid", window=4)
