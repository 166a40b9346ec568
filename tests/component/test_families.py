"""Ten tiny causal-LM families through the generic adapter: geometry, capture, conversion, refusals."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn
from transformers import Gemma3Config, GptOssConfig, GptOssForCausalLM, GraniteConfig, GraniteForCausalLM, T5Config

from dofla.models import (
    ADAPTERS,
    ModelLoadError,
    UnsupportedModelError,
    capture_qkv,
    capturing,
    check_supported,
    convert,
    get_adapter,
    load_student,
    load_teacher,
)
from dofla.models.adapters import GenericAdapter, probe_attention_calls
from dofla.models.adapters.support import check_modules
from dofla.models.capture import softcapped_attention
from dofla.models.tiny import TINY_FAMILIES, TINY_WINDOW, build_tiny_model
from tests.integration.test_pipeline import run_cli

FAMILIES = list(TINY_FAMILIES)
LONG = 2 * TINY_WINDOW + 8  # longer than every tiny sliding window
TINY_KW = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=257, max_position_embeddings=512, head_dim=16)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def _ids(batch: int = 2, length: int = LONG, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _reference_attention(q, k, v, window, softcap):
    """Plain causal softmax attention, logits q·k/sqrt(d), optionally capped and windowed: (B, T, H·d)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2).flatten(2)


def _attention_outputs(model, ids) -> list[torch.Tensor]:
    """Each layer's attention output (B, T, H·d), as its output projection receives it."""
    outputs = []
    hooks = [next(c for n, c in m.named_children() if n in ("o_proj", "c_proj", "dense"))
             .register_forward_pre_hook(lambda _, args: outputs.append(args[0].detach()))
             for m in get_adapter(model).attention_modules(model)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return outputs


def test_layer_windows_follow_what_transformers_does():
    families = ("gemma2", "gemma3", "qwen2", "mistral", "llama")
    windows = {f: get_adapter(m).geometry(m.config).layer_windows
               for f, m in ((f, build_tiny_model(f, num_layers=4)) for f in families)}
    w = TINY_WINDOW
    assert windows == {"gemma2": (w, None, w, None), "gemma3": (w, None, w, None), "qwen2": (None, w, w, w),
                       "mistral": (w, w, w, w), "llama": (None,) * 4}
    gemma2 = build_tiny_model("gemma2")
    assert get_adapter(gemma2).geometry(gemma2.config).softcap == 5.0


def test_every_family_passes_the_probe_and_gets_its_adapter(family):
    model = build_tiny_model(family)
    check_supported(model, probe=True)
    adapter = get_adapter(model)
    assert len(adapter.attention_modules(model)) == 2
    named = dict(model.named_modules())
    assert all(any(name.endswith(t) for name in named) for t in adapter.lora_targets)


def test_capture_shapes_follow_geometry(family):
    model = build_tiny_model(family)
    g = get_adapter(model).geometry(model.config)
    captured = capture_qkv(model, _ids(length=20))
    assert len(captured) == g.num_layers
    for q, k, v in captured:
        assert q.shape == (2, g.num_heads, 20, g.head_dim)
        assert k.shape == v.shape == (2, g.num_kv_heads, 20, g.head_dim)


def test_capturing_leaves_the_teacher_forward_unchanged(family):
    model, ids = build_tiny_model(family), _ids()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with capturing(model, get_adapter(model).attention_modules(model), lambda *_: None):
            captured = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(captured, plain, atol=1e-6, rtol=0)


def _sharpen(model, factor: float = 40.0) -> None:
    """Scale the query projections so logits reach the soft-cap (random init keeps them near 0)."""
    for module in get_adapter(model).attention_modules(model):
        proj = next(c for n, c in module.named_children() if n in ("q_proj", "c_attn", "query_key_value", "qkv_proj"))
        with torch.no_grad():
            proj.weight.mul_(factor)


@pytest.mark.parametrize("name", FAMILIES + ["granite"])
def test_captured_qkv_reproduce_the_teachers_attention(name):
    """q carries the module's own scaling (Gemma's query_pre_attn_scalar, Granite's multiplier)."""
    if name == "granite":  # not registered: the generic fallback, attention_multiplier != 1/sqrt(d)
        config = GraniteConfig(**TINY_KW, attention_multiplier=0.5, bos_token_id=256, eos_token_id=256)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = GraniteForCausalLM(config).eval()
        assert "granite" not in ADAPTERS and type(get_adapter(model)) is GenericAdapter
    else:
        model = build_tiny_model(name)
    _sharpen(model)
    g, ids = get_adapter(model).geometry(model.config), _ids()
    captured, outputs = capture_qkv(model, ids), _attention_outputs(model, ids)
    for (q, k, v), out, window in zip(captured, outputs, g.layer_windows):
        torch.testing.assert_close(_reference_attention(q, k, v, window, g.softcap), out, atol=2e-5, rtol=1e-4)
    if g.softcap is not None or any(g.layer_windows):  # the test can tell a kernel without them apart
        i = 0 if g.softcap is not None else g.sliding_layers[0]
        assert not torch.allclose(_reference_attention(*captured[i], None, None), outputs[i], atol=1e-3)


def test_softcapped_attention_without_a_cap_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(softcapped_attention(q, k, v, None, 0.3, softcap=1e6), expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(softcapped_attention(q, k, v, None, 0.3, softcap=0.5), expected, atol=1e-2)


def test_softmax_reference_reproduces_the_teacher_beyond_the_window(family):
    teacher, ids = build_tiny_model(family), _ids()
    reference = convert(copy.deepcopy(teacher), feature_map="softmax")
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=ids).logits, teacher(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_student_generates_what_its_full_forward_predicts(family, tmp_path):
    convert(build_tiny_model(family), feature_map="learned_prf", dims=[8, 8], chunk_size=8).save_pretrained(tmp_path)
    student = load_student(tmp_path)
    prompt = _ids(batch=1, length=10)
    out = student.generate(prompt, max_new_tokens=LONG - 10, min_new_tokens=LONG - 10, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        full = student(input_ids=out.sequences, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, 9:-1], atol=1e-4, rtol=1e-4)
    assert torch.equal(out.sequences[:, 10:], full[:, 9:-1].argmax(-1))


def test_lora_targets_wrap_every_attention_projection(family):
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model(family)
    targets = get_adapter(model).lora_targets
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets, fan_in_fan_out=family == "gpt2"))
    wrapped = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and n.endswith(tuple(targets))]
    assert len(wrapped) == 2 * len(targets) and len(targets) >= 2
    assert len(get_adapter(model).attention_modules(model)) == 2  # still found once LoRA-wrapped


@pytest.mark.parametrize("config,needle", [
    (T5Config(d_model=64, num_layers=2, num_heads=4, d_kv=16, d_ff=128, vocab_size=257), "'t5' is an encoder-decoder"),
    (GptOssConfig(**TINY_KW, num_local_experts=2), "'gpt_oss' has learned attention sinks"),
    (Gemma3Config(), "'gemma3' is a multimodal model"),
])
def test_unsupported_configs_are_refused_in_one_sentence(config, needle):
    with pytest.raises(UnsupportedModelError) as err:
        get_adapter(config)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_learned_sinks_are_found_in_the_modules_and_in_the_attention_call():
    config = GptOssConfig(**TINY_KW, num_local_experts=2, num_experts_per_tok=1, bos_token_id=256, eos_token_id=256)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="learned attention sinks"):
        check_modules(model)
    with pytest.raises(UnsupportedModelError, match="sinks or position biases"):
        probe_attention_calls(model)


def test_code_that_bypasses_the_attention_interface_is_refused():
    model = build_tiny_model("llama")
    model.model.layers[1].self_attn.forward = lambda hidden_states, *a, **kw: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModelError, match="does not call transformers' attention interface"):
        check_supported(model, probe=True)
    model = build_tiny_model("llama")
    for layer in model.model.layers:
        del layer.self_attn.layer_idx
    with pytest.raises(UnsupportedModelError, match="no self-attention modules"):
        get_adapter(model)


def test_windows_the_config_does_not_declare_are_refused():
    model = build_tiny_model("gemma2")
    model.config.layer_types = ["full_attention"] * 2  # the modules still slide layer 0
    with pytest.raises(UnsupportedModelError, match="slides layer 0 over 16 tokens"):
        check_supported(model, probe=True)


def test_load_teacher_builds_every_tiny_family_and_names_the_valid_ones():
    for family in FAMILIES:
        model, tokenizer = load_teacher(f"tiny:{family}")
        assert model.config.vocab_size == len(tokenizer)
    with pytest.raises(ModelLoadError, match="tiny:qwen3"):
        load_teacher("tiny:qwen4")


@pytest.mark.parametrize("name", ["gemma2", "qwen3"])
def test_local_checkpoint_loads_checked_with_the_right_attention(name, tmp_path, byte_tokenizer):
    teacher = build_tiny_model(name)
    teacher.save_pretrained(tmp_path)
    byte_tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_teacher(str(tmp_path))
    assert loaded.config._attn_implementation == ("eager" if name == "gemma2" else "sdpa")  # SDPA cannot soft-cap
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=_ids()).logits, teacher(input_ids=_ids()).logits)


@pytest.mark.slow  # runs the CLI
def test_pipeline_runs_on_tiny_qwen3(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", "model.source=tiny:qwen3",
                     f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert math.isfinite(metrics["eval/teacher_ppl"]) and math.isfinite(metrics["eval/student_ppl"])
    assert json.loads((run_dir / "student" / "config.json").read_text())["teacher_model_type"] == "qwen3"
