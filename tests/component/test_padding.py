"""Left padding: pad tokens must not leak into any student's attention or decoding state."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

from dofla.attention import hybrid_attention_chunked
from dofla.models import convert
from dofla.models.tiny import build_tiny_model

STUDENTS = {
    "linear": dict(feature_map="learned_prf", dims=[8, 8], chunk_size=4),
    "hybrid": dict(feature_map="learned_prf", dims=[8, 8], attention="hybrid", window=3, sinks=2, chunk_size=4),
    "sliding_window": dict(attention="sliding_window", window=4, sinks=2, chunk_size=3),
    "softmax": dict(feature_map="softmax"),
    # a layer restored to softmax among linear / hybrid ones: the 4D mask for it, key_valid for the others
    "linear+softmax": dict(feature_map="learned_prf", dims=[8, 8], chunk_size=4, softmax_layers=[1]),
    "hybrid+softmax": dict(feature_map="learned_prf", dims=[8, 8], attention="hybrid", window=3, sinks=2,
                           chunk_size=4, softmax_layers=[0]),
}
HYBRID_MASKS = "key_valid" in inspect.signature(hybrid_attention_chunked).parameters


def _student(arch: str, kind: str):
    if kind == "hybrid" and not HYBRID_MASKS:
        pytest.skip("hybrid_attention_chunked takes no key_valid yet (comes with the stabiliser work)")
    return convert(build_tiny_model(arch, seed=0), **copy.deepcopy(STUDENTS[kind]))


def _rows(lengths=(13, 6, 9), seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _left_padded(rows, seed=7):
    """Batch of left-padded rows; the pads are random tokens (not EOS), so a leak changes outputs."""
    width = max(len(r) for r in rows)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(rows), width), generator=g)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


GENERATE = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=256)


@pytest.mark.parametrize("kind", list(STUDENTS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_batched_left_padded_generate_equals_each_row_alone(arch, kind):
    student = _student(arch, kind)
    rows = _rows()
    ids, mask = _left_padded(rows)
    batched = student.generate(ids, attention_mask=mask, **GENERATE)
    width = ids.shape[1]
    for i, row in enumerate(rows):
        alone = student.generate(row[None], **GENERATE)[0]
        assert torch.equal(batched[i, width - len(row):], alone), f"row {i} differs"


@pytest.mark.parametrize("kind", list(STUDENTS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padded_forward_equals_row_alone_on_valid_positions(arch, kind):
    student = _student(arch, kind)
    rows = _rows(lengths=(11, 4))
    ids, mask = _left_padded(rows)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # what generate() passes for left padding
    with torch.no_grad():
        padded = student(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        alone = student(rows[1][None], use_cache=False).logits
    assert torch.allclose(padded[1, -4:], alone[0], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(padded).all()


def test_padding_mask_must_be_two_dimensional():
    student = _student("llama", "linear")
    ids, mask = _left_padded(_rows(lengths=(5, 3)))
    with pytest.raises(ValueError, match="2D"):
        student(ids, attention_mask=mask[:, None, None, :].bool(), use_cache=False)
