"""Students of teachers with their own attention shapes (sliding windows, softcaps, module scaling)
and the generation paths (padding, beam search) that must match the teacher or the parallel forward."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.models import ConversionSpec, RecurrentStateCache, convert, get_adapter, load_student
from dofla.models.tiny import build_tiny_model

from .test_student import _greedy_by_parallel_forward, _ids


GENERATE = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=256)


def _left_padded(batch=2, length=12, pad=5):
    ids = _ids(batch=batch, length=length, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def test_softmax_reference_generates_like_teacher(tiny_model):
    student = convert(copy.deepcopy(tiny_model), feature_map="softmax")
    prompt = _ids(batch=1, length=9)
    assert torch.equal(student.generate(prompt, **GENERATE), tiny_model.generate(prompt, **GENERATE))
    ids, mask = _left_padded()  # padding: the teacher's own mask applies
    assert torch.equal(student.generate(ids, attention_mask=mask, **GENERATE),
                       tiny_model.generate(ids, attention_mask=mask, **GENERATE))


def _tiny(config_cls, model_cls, attn="sdpa", **options):
    config = config_cls(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                        bos_token_id=256, eos_token_id=256, **options)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).eval()


def _geometry_or_skip(model, *fields):
    try:
        geometry = get_adapter(model).geometry(model.config)
    except (KeyError, ValueError):
        pytest.skip(f"no adapter for {model.config.model_type} yet (the generic adapter adds it)")
    if any(getattr(geometry, f, None) is None for f in fields):
        pytest.skip(f"AttentionGeometry has no {', '.join(fields)} yet (the adapter work adds them)")


def _assert_same_logits(a, b, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        la = a(ids, attention_mask=mask, position_ids=positions).logits
        lb = b(ids, attention_mask=mask, position_ids=positions).logits
    assert (la - lb)[mask.bool()].abs().max().item() < 1e-4


def test_softmax_reference_applies_the_teachers_sliding_window_mask():
    from transformers import MistralConfig, MistralForCausalLM
    teacher = _tiny(MistralConfig, MistralForCausalLM, sliding_window=4)
    student = convert(copy.deepcopy(teacher), feature_map="softmax")
    ids, mask = _left_padded()
    _assert_same_logits(teacher, student, ids, mask)
    assert torch.equal(student.generate(ids, attention_mask=mask, **GENERATE),
                       teacher.generate(ids, attention_mask=mask, **GENERATE))
    full = copy.deepcopy(teacher)
    full.config.sliding_window = None  # the window matters at this length, so the check above is real
    assert not torch.allclose(full(ids).logits, teacher(ids).logits, atol=1e-3)


def test_teacher_sliding_layers_become_exact_sliding_window():
    from transformers import MistralConfig, MistralForCausalLM
    teacher = _tiny(MistralConfig, MistralForCausalLM, sliding_window=4)
    _geometry_or_skip(teacher, "layer_windows")
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", chunk_size=5)
    assert [(a.mode, a.window, a.sinks) for a in student.student_attentions()] == [("sliding_window", 4, 0)] * 2
    _assert_same_logits(teacher, student, *_left_padded())


def test_gemma2_softcap_scaling_and_local_layers_are_exact():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    options = dict(head_dim=16, sliding_window=4, attn_logit_softcapping=0.1, query_pre_attn_scalar=8)
    teacher = _tiny(Gemma2Config, Gemma2ForCausalLM, attn="eager", **options)
    _geometry_or_skip(teacher, "layer_windows", "softcap")
    ids, mask = _left_padded()
    reference = convert(copy.deepcopy(teacher), feature_map="softmax")
    _assert_same_logits(teacher, reference, ids, mask)
    assert torch.equal(reference.generate(ids, attention_mask=mask, **GENERATE),
                       teacher.generate(ids, attention_mask=mask, **GENERATE))
    exact = convert(copy.deepcopy(teacher), attention="sliding_window", window=64, sinks=0, chunk_size=5)
    _assert_same_logits(teacher, exact, ids, mask)  # local layers: W = 4; global: a window over everything
    linear = convert(copy.deepcopy(teacher), feature_map="learned_prf")
    assert [a.mode for a in linear.student_attentions()] == ["sliding_window", "linear"]
    uncapped = copy.deepcopy(teacher)  # the cap changes the teacher, so matching it above is a real check
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert not torch.allclose(uncapped(ids).logits, teacher(ids).logits, atol=1e-3)


def test_module_scaling_is_honoured():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)  # GPT-2 scales layer l's scores by 1 / (sqrt(d) (l + 1)) here
    config = GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True)
    teacher = GPT2LMHeadModel(config).eval()
    ids, mask = _left_padded()
    _assert_same_logits(teacher, convert(copy.deepcopy(teacher), feature_map="softmax"), ids, mask)
    exact = convert(copy.deepcopy(teacher), attention="sliding_window", window=64, sinks=0, chunk_size=5)
    _assert_same_logits(teacher, exact, ids, mask)


def test_sliding_window_student_saves_loads_and_decodes_in_bounded_memory(tiny_model, tmp_path):
    student = convert(tiny_model, attention="sliding_window", window=4, sinks=2, chunk_size=3)
    student.save_pretrained(tmp_path)
    student = load_student(tmp_path)
    assert [(a.mode, a.window, a.sinks) for a in student.student_attentions()] == [("sliding_window", 4, 2)] * 2
    prompt = _ids(batch=1, length=9)
    out = student.generate(prompt, **GENERATE)
    assert torch.equal(out, _greedy_by_parallel_forward(student, prompt, 10))
    cache, sizes = RecurrentStateCache(2), []
    with torch.no_grad():
        for t in range(20):
            student(_ids(batch=1, length=20)[:, t:t + 1], past_key_values=cache)
            sizes.append(cache.state_bytes())
    assert sizes[8] == sizes[19] > 0


@pytest.mark.parametrize("options", [dict(attention="sliding_window", window=3, sinks=1), dict(feature_map="softmax")])
def test_beam_search_with_cache_equals_without(options):
    student = convert(build_tiny_model("llama"), chunk_size=4, **options)
    prompt = _ids(batch=1, length=7)
    beams = dict(num_beams=3, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=256)
    assert torch.equal(student.generate(prompt, **beams), student.generate(prompt, use_cache=False, **beams))


def test_old_specs_load_and_bad_attention_settings_fail_clearly():
    old = ConversionSpec(**{"dims": [4, 4], "window": 5, "format_version": 1})  # saved before attention/sinks
    assert (old.attention, old.sinks) == ("hybrid", 0)
    assert ConversionSpec(dims=[4, 4]).attention == "linear"
    for bad, word in [({"attention": "local"}, "attention"), ({"attention": "sliding_window"}, "window"),
                      ({"sinks": 2}, "sinks"), ({"feature_map": "softmax", "window": 3}, "softmax")]:
        with pytest.raises(ValueError, match=word) as err:
            ConversionSpec(dims=[4, 4], **bad)
        assert "\n" not in str(err.value)
