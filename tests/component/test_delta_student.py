"""A gated-delta student (``attention="gated_delta"``, pure and as the hybrid's older part) on tiny
models: it converts with DoF-sized states, its forward does not depend on the chunk, it decodes like
its parallel forward, pads like a lone row, saves and loads as itself, keeps exact softmax layers,
trains layer by layer on the output loss and end to end on the KL, and refuses what it cannot do."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.attention.delta import DeltaState
from dofla.config import RunConfig
from dofla.errors import DoflaError
from dofla.models import RecurrentStateCache, convert, load_student, restore_softmax
from dofla.models.capture import capture_qkv
from dofla.models.tiny import build_tiny_model
from dofla.train import LayerTrainConfig
from dofla.train.direct import RandomRows
from dofla.train.distill import DistillSchedule, attention_projections, prepare_trainable, train_kl
from dofla.train.layerwise import train_layer
from dofla.validate import ConfigError, validate_config
from tests.conftest import logits_of, token_ids

PURE = {"attention": "gated_delta"}
HYBRID = {"attention": "gated_delta", "window": 5, "sinks": 2}
FORMS = pytest.mark.parametrize("form", [PURE, HYBRID], ids=["pure", "hybrid"])


def _delta(model, dims=(16, 16), **form):
    return convert(model, feature_map="hedgehog", dims=list(dims), chunk_size=4, **form)


def _open(student, seed=2):
    """Move every gate off its start, so decay, overwriting and the output gate all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in student.student_attentions():
            if attn.feature_map is not None:
                for p in attn.feature_map.gates.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
    return student


def _llama():
    return build_tiny_model("llama", seed=0)  # GQA: 4 query heads, 2 key/value heads


def test_it_converts_with_dof_sized_states_and_the_chunk_does_not_change_the_output(tiny_model):
    student = _open(_delta(tiny_model, dims=(8, 24), **PURE))
    assert [a.mode for a in student.student_attentions()] == ["gated_delta", "gated_delta"]
    ids = token_ids()
    small = logits_of(student, ids)
    for attn in student.student_attentions():
        attn.chunk_size = 64
    torch.testing.assert_close(logits_of(student, ids), small, rtol=1e-4, atol=1e-4)
    cache = RecurrentStateCache(2)
    with torch.no_grad():
        student(ids, past_key_values=cache)
    states = [layer.state for layer in cache.layers]
    assert all(isinstance(s, DeltaState) for s in states)
    assert [s.S.shape[2] for s in states] == [8, 24]  # M per layer from the allocation: state M×dv per head


@FORMS
def test_decoding_equals_the_parallel_forward_and_generate_is_greedy(form):
    student = _open(_delta(_llama(), **form))
    ids = token_ids(length=21)
    full = logits_of(student, ids)
    cache = RecurrentStateCache(2)
    with torch.no_grad():
        first = student(ids[:, :11], past_key_values=cache).logits
        rest = [student(ids[:, t:t + 1], past_key_values=cache).logits for t in range(11, 21)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-4, atol=1e-4)
    before = cache.state_bytes()
    with torch.no_grad():
        student(ids[:, :1], past_key_values=cache)
    assert cache.state_bytes() == before  # O(1) in the tokens seen
    prompt = ids[:1, :7]
    out = student.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=256)
    expected = prompt
    for _ in range(8):
        expected = torch.cat([expected, logits_of(student, expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, expected)


@FORMS
def test_it_saves_and_loads_as_itself(form, tmp_path):
    student = _open(_delta(_llama(), **form))
    with torch.no_grad():
        student.student_attentions()[1].feature_map.calibrated.fill_(True)
    ids = token_ids()
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert type(reloaded).__name__.startswith("Linear") and reloaded.config.dofla["attention"] == "gated_delta"
    assert [a.mode for a in reloaded.student_attentions()] == [a.mode for a in student.student_attentions()]
    assert [bool(a.feature_map.calibrated) for a in reloaded.student_attentions()] == [False, True]
    assert torch.equal(logits_of(reloaded, ids), logits_of(student, ids))


@FORMS
def test_a_left_padded_row_equals_the_row_alone(form):
    student = _open(_delta(_llama(), **form))
    ids = token_ids(batch=1, length=15)
    pads = 4
    padded = torch.cat([torch.zeros(1, pads, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones(1, 15, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = logits_of(student, padded, attention_mask=mask, position_ids=position_ids)[:, pads:]
    torch.testing.assert_close(out, logits_of(student, ids), rtol=1e-4, atol=1e-4)


def test_the_hybrid_is_the_teacher_on_a_context_inside_its_window(tiny_model):
    teacher = copy.deepcopy(tiny_model)
    student = _open(_delta(tiny_model, attention="gated_delta", window=32, sinks=2))
    assert {a.mode for a in student.student_attentions()} == {"hybrid"}
    ids = token_ids(length=30)
    torch.testing.assert_close(logits_of(student, ids), logits_of(teacher, ids), rtol=1e-4, atol=1e-4)
    assert (logits_of(student, token_ids(length=60)) - logits_of(teacher, token_ids(length=60))).abs().max() > 1e-3


def test_a_layer_restored_to_softmax_stays_exact_after_a_reload(tmp_path):
    teacher = _llama()
    student = restore_softmax(_open(_delta(copy.deepcopy(teacher), **PURE)), [0])
    assert [a.mode for a in student.student_attentions()] == ["softmax", "gated_delta"]
    ids = token_ids(length=21)
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert [a.mode for a in reloaded.student_attentions()] == ["softmax", "gated_delta"]
    full = logits_of(reloaded, ids)
    assert torch.equal(full, logits_of(student, ids))
    cache = RecurrentStateCache(2)
    with torch.no_grad():
        parts = [reloaded(ids[:, :13], past_key_values=cache).logits]
        parts += [reloaded(ids[:, t:t + 1], past_key_values=cache).logits for t in range(13, 21)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [0, 6])
def test_layerwise_training_lowers_the_output_loss(window):
    student = _delta(_llama(), **(PURE if window == 0 else HYBRID | {"window": window}))
    layer = student.student_attentions()[1].feature_map
    q, k, v = capture_qkv(_llama(), token_ids(batch=16, length=32))[1]  # the teacher's own activations
    cfg = LayerTrainConfig(steps=30, batch_size=4, loss="output", eval_every=10, warmup_steps=2, window=window,
                           sinks=2 if window else 0, heldout_fraction=0.25)
    beta_before = layer.gates.beta_bias.detach().clone()
    result = train_layer(layer, q, k, cfg, v=v)
    assert bool(layer.calibrated)  # the gain was fitted on the first batch, before any step
    assert result.final_heldout_loss < 0.98 * result.initial_heldout_loss
    assert not torch.equal(layer.gates.beta_bias, beta_before)


def test_a_kl_step_trains_the_gates_with_the_features(tiny_model):
    teacher = copy.deepcopy(tiny_model).eval()
    student = _delta(tiny_model, **PURE)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a student that differs from its teacher, so the KL has a gradient
        for p in attention_projections(student):
            if p.ndim == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    gates = [p.detach().clone() for a in student.student_attentions() for p in a.feature_map.gates.parameters()]
    schedule = DistillSchedule(steps=3, micro_batch_size=4, lr=1e-2, feature_lr=3e-2, warmup_steps=1)
    student, _, _ = train_kl(student, teacher, RandomRows(token_ids(batch=8, length=24), 4, seed=0), ["features"],
                             schedule)
    after = [p for a in student.student_attentions() for p in a.feature_map.gates.parameters()]
    assert sum(not torch.equal(a, b) for a, b in zip(gates, after)) == len(after)
    with pytest.raises(DoflaError, match="leaves nothing to train"):  # `gate` names the scalar gate only
        prepare_trainable(student, ["gate"])


def test_bad_delta_settings_fail_in_one_sentence(tiny_model):
    with pytest.raises(ValueError, match="own decay and output gates"):
        _delta(copy.deepcopy(tiny_model), gate="scalar", **PURE)
    with pytest.raises(ValueError, match="per-head dims"):
        _delta(copy.deepcopy(tiny_model), dims=([8, 8, 16, 16], 16), **PURE)
    with pytest.raises(ValueError, match="needs window"):
        _delta(copy.deepcopy(tiny_model), sinks=2, **PURE)


BAD_CONFIGS = [
    ({"loss": "softmax"}, "loss=softmax compares attention kernels"),
    ({"loss": "l2"}, "loss=l2 compares attention kernels"),
    ({"policy": "dof_head"}, "allocation.policy=dof_head"),
    ({"sinks": 2}, "attention.sinks=2 needs an exact part"),
    ({"compile": True}, "train.compile"),
    ({"gate": "scalar"}, "attention.gate=scalar"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_bad_delta_configs_fail_before_any_model_loads(change, message):
    cfg = RunConfig()
    cfg.attention.name, cfg.attention.chunk_size, cfg.loss.name = "gated_delta", 64, "output"
    cfg.feature_map.name = "hedgehog"
    cfg.loss.name = change.get("loss", "output")
    cfg.allocation.policy = change.get("policy", "fix")
    cfg.attention.sinks = change.get("sinks", 0)
    cfg.attention.gate = change.get("gate", "none")
    cfg.train.compile = change.get("compile", False)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate_config(cfg)


def test_a_good_delta_config_passes_and_its_layers_are_keyed_apart_from_linear_ones():
    from dofla.stages.keys import layer_meta

    cfg = RunConfig()
    cfg.attention.name, cfg.attention.chunk_size, cfg.loss.name = "gated_delta", 64, "output"
    cfg.feature_map.name, cfg.allocation.policy = "hedgehog", "fix"
    validate_config(cfg)
    cfg.attention.window, cfg.attention.sinks = 64, 4
    validate_config(cfg)
    delta = layer_meta(cfg, "cache")
    cfg.attention.name = "hybrid"
    assert delta["attention"] == "gated_delta" and "attention" not in layer_meta(cfg, "cache")
