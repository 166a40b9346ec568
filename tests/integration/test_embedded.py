"""The real embedded SmolLM2-135M: loading, the README's Python snippet, capture geometry."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla import convert, load_student, load_teacher
from dofla.models import EMBEDDED, capture_qkv, get_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_teacher(EMBEDDED)


def test_embedded_geometry_and_capture(smollm2):
    model, tokenizer = smollm2
    g = get_adapter(model).geometry(model.config)
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == (30, 9, 3, 64)
    ids = tokenizer("In the beginning God created the heaven and the earth.", return_tensors="pt").input_ids
    q, k, v = capture_qkv(model, ids)[7]
    assert q.shape == (1, 9, ids.shape[1], 64) and k.shape == v.shape == (1, 3, ids.shape[1], 64)


def test_softmax_reference_reproduces_smollm2(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("And God said, Let there be light: and there was light.", return_tensors="pt").input_ids
    with torch.no_grad():
        teacher = model(ids).logits
        swapped = convert(copy.deepcopy(model), feature_map="softmax")(ids, use_cache=False).logits
    assert (teacher - swapped).abs().max().item() < 1e-4


def test_readme_snippet_on_embedded_model(smollm2, tmp_path):
    model, tokenizer = smollm2
    student = convert(copy.deepcopy(model), feature_map="learned_prf", dims=[64] * 30)
    student.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    ids = tokenizer("The Lord is my shepherd", return_tensors="pt").input_ids
    out = reloaded.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape == (1, ids.shape[1] + 8)
    with torch.no_grad():
        assert torch.equal(student(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits)
