"""Converting tiny GPT-2 / GPT-NeoX / Llama models: softmax reference, save/load, generate."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.models import (
    RecurrentStateCache,
    capture_qkv,
    convert,
    get_adapter,
    load_student,
)
from dofla.attention import linear_attention_naive
from dofla.feature_maps import HeadBlockFeatureMap
from dofla.models.loading import ModelLoadError, load_teacher


def _ids(batch=2, length=33, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _greedy_by_parallel_forward(model, prompt, steps):
    """Greedy continuation re-running the full parallel forward on the whole prefix each step."""
    tokens = prompt
    for _ in range(steps):
        logits = model(tokens, use_cache=False).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_softmax_reference_reproduces_teacher_logits(tiny_model):
    ids = _ids()
    with torch.no_grad():
        teacher = tiny_model(ids).logits
        student = convert(copy.deepcopy(tiny_model), feature_map="softmax")
        swapped = student(ids, use_cache=False).logits
    assert (teacher - swapped).abs().max().item() < 1e-4


def test_capture_shapes_follow_geometry(tiny_model):
    geometry = get_adapter(tiny_model).geometry(tiny_model.config)
    layers = capture_qkv(tiny_model, _ids(batch=3, length=11))
    assert len(layers) == geometry.num_layers
    for q, k, v in layers:
        assert q.shape == (3, geometry.num_heads, 11, geometry.head_dim)
        assert k.shape == v.shape == (3, geometry.num_kv_heads, 11, geometry.head_dim)


def test_save_load_roundtrip_gives_identical_logits(tiny_model, tmp_path):
    student = convert(tiny_model, feature_map="learned_prf", dims=[5, 9], seed=3)
    with torch.no_grad():  # make the feature parameters differ from their initial draw
        for attn in student.student_attentions():
            for p in attn.parameters():
                p.add_(0.01 * torch.randn_like(p))
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert [a.num_features for a in reloaded.student_attentions()] == [5, 9]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(student(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits)


def test_greedy_generate_matches_parallel_argmax(tiny_model):
    student = convert(tiny_model, feature_map="learned_prf", dims=[6, 4])
    prompt = _ids(batch=1, length=9)
    out = student.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(out, _greedy_by_parallel_forward(student, prompt, 12))


def test_decoding_state_does_not_grow(tiny_model):
    student = convert(tiny_model, feature_map="performer", dims=[8, 8])
    cache = RecurrentStateCache(2)
    ids = _ids(batch=1, length=4)
    sizes = []
    with torch.no_grad():
        out = student(ids, past_key_values=cache)
        for step in range(30):
            nxt = out.logits[:, -1:].argmax(-1)
            out = student(nxt, past_key_values=cache)
            if step in (5, 29):
                sizes.append(cache.state_bytes())
    assert cache.get_seq_length() == 34
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])  # transformers ≥ 5.24 / before
def test_prefill_then_decode_equals_full_forward(tiny_model, keyword):
    student = convert(tiny_model, feature_map="learned_prf", dims=[7, 3], chunk_size=4)
    ids = _ids(batch=2, length=21)
    with torch.no_grad():
        full = student(ids, use_cache=False).logits
        cache = RecurrentStateCache(2)
        first = student(ids[:, :13], **{keyword: cache}).logits
        rest = [student(ids[:, t : t + 1], **{keyword: cache}).logits for t in range(13, 21)]
    stepped = torch.cat([first, *rest], dim=1)
    assert torch.allclose(stepped, full, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 21


def test_two_different_caches_are_refused(tiny_model):
    student = convert(tiny_model, feature_map="performer", dims=[4, 4])
    with pytest.raises(ValueError, match="pass one"):
        student(_ids(batch=1, length=3), cache=RecurrentStateCache(2), past_key_values=RecurrentStateCache(2))


@pytest.mark.parametrize("attention", ["linear", "hybrid"])
def test_sampling_with_cache_equals_sampling_without(tiny_model, attention):
    window = 3 if attention == "hybrid" else 0
    student = convert(tiny_model, feature_map="learned_prf", dims=[6, 4], attention=attention, window=window)
    prompt = _ids(batch=2, length=7)
    options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(3)
    cached = student.generate(prompt, **options)
    torch.manual_seed(3)
    recomputed = student.generate(prompt, use_cache=False, **options)
    assert torch.equal(cached, recomputed)


def test_unknown_hub_model_fails_with_one_sentence():
    with pytest.raises(ModelLoadError) as err:
        load_teacher("dofla-tests/no-such-model-anywhere")
    message = str(err.value)
    assert "no-such-model-anywhere" in message and "\n" not in message


def test_hybrid_student_generates_like_its_parallel_forward(tiny_model, tmp_path):
    student = convert(tiny_model, feature_map="learned_prf", dims=[6, 4], window=5, chunk_size=4)
    student.save_pretrained(tmp_path)
    student = load_student(tmp_path)
    assert all(a.window == 5 for a in student.student_attentions())
    prompt = _ids(batch=1, length=9)
    out = student.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(out, _greedy_by_parallel_forward(student, prompt, 10))


# --- per-head dims (dof_head): heads of equal dim share one block, nothing is padded ---------------

HEAD_DIMS = [[8, 16, 8, 24], [16, 16, 16, 16]]  # layer 0: three blocks; layer 1: one (a plain map)


def test_per_head_dims_are_blocks_without_padding(tiny_model):
    student = convert(tiny_model, feature_map="learned_prf", dims=HEAD_DIMS, seed=2)
    first, second = (a.feature_map for a in student.student_attentions())
    assert isinstance(first, HeadBlockFeatureMap) and not isinstance(second, HeadBlockFeatureMap)
    assert first.heads == [[0, 2], [1], [3]]
    assert [(b.num_heads, b.num_features) for b in first.blocks] == [(2, 8), (1, 16), (1, 24)]
    q = torch.randn(2, 4, 7, 16)  # the features computed are exactly the per-head dims
    assert sum(b.log_features(q[:, h]).shape[-1] * len(h) for b, h in zip(first.blocks, first.heads)) == 56


def test_per_head_attention_equals_each_blocks_naive_attention(tiny_model):
    student = convert(tiny_model, feature_map="learned_prf", dims=HEAD_DIMS, chunk_size=4)
    attn = student.student_attentions()[0]
    geometry = get_adapter(tiny_model).geometry(tiny_model.config)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, geometry.num_heads, 13, geometry.head_dim, generator=g)
    k = torch.randn(2, geometry.num_kv_heads, 13, geometry.head_dim, generator=g)
    v = torch.randn(2, geometry.num_kv_heads, 13, geometry.head_dim, generator=g)
    with torch.no_grad():
        out, _ = attn(q, k, v)
        group = geometry.num_heads // geometry.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for block, heads in zip(attn.feature_map.blocks, attn.feature_map.heads):
            ref = linear_attention_naive(block.log_features(q[:, heads]), block.log_features(k[:, heads]),
                                         v[:, heads])
            assert torch.allclose(out[:, heads], ref, atol=1e-5, rtol=1e-4)


def test_per_head_student_saves_loads_and_generates(tiny_model, tmp_path):
    student = convert(tiny_model, feature_map="learned_prf", dims=HEAD_DIMS, seed=1)
    with torch.no_grad():
        for p in student.student_attentions()[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    assert reloaded.student_attentions()[0].feature_map.head_dims == HEAD_DIMS[0]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(student(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits)
    prompt = _ids(batch=1, length=9)
    out = reloaded.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(out, _greedy_by_parallel_forward(reloaded, prompt, 10))


# --- softmax reference with a real KV cache; sliding-window students; teacher windows, softcap ----
