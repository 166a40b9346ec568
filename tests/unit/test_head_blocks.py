"""Per-head feature dims decode with one recurrence for all blocks: each block's features padded to
the widest (padding features −inf, so they hold nothing) and one merged state. Decoding token by
token must equal the one-pass forward, also when a chunked call follows the decoding steps (the
merged state split back into blocks), with the gate and with padding; the merged form must split
into exactly the per-block states and keep its size while decoding.
"""
from __future__ import annotations

import pytest
import torch

from dofla.attention.gate import build_gate
from dofla.feature_maps.blocks import BlockState, build_layer_feature_map
from dofla.models.student_attention import StudentAttention

HEADS, KV_HEADS, D = 6, 3, 8
DIMS = [4, 12, 4, 7, 12, 4]  # three blocks of different widths, heads interleaved


def _layer(gate: bool, name: str = "learned_prf") -> StudentAttention:
    torch.manual_seed(0)
    fm = build_layer_feature_map(name, HEADS, D, DIMS, seed=3)
    return StudentAttention(HEADS, KV_HEADS, D, fm, chunk_size=4, gate=build_gate("scalar", HEADS, D) if gate else None)


def _inputs(t: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, HEADS, t, D, generator=g), torch.randn(2, KV_HEADS, t, D, generator=g),
            torch.randn(2, KV_HEADS, t, D, generator=g))


def _valid(t: int):
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :3] = False  # the second row is left-padded
    return valid


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["learned_prf", "hedgehog"])  # PRF blocks merge into one map; others pad
@torch.no_grad()
def test_decoding_blocks_token_by_token_equals_the_one_pass_forward(gate, padded, name):
    layer = _layer(gate, name)
    if gate:  # move the gate off its identity start so decays matter
        for p in layer.gate.parameters():
            p.uniform_(0.2, 0.8)
    q, k, v = _inputs(17)
    valid = _valid(17) if padded else None
    full, _ = layer(q, k, v, key_valid=valid)
    cut = lambda x, lo, hi: x[:, :, lo:hi]  # noqa: E731
    mask = lambda lo, hi: None if valid is None else valid[:, lo:hi]  # noqa: E731
    outs = []
    out, state = layer(cut(q, 0, 6), cut(k, 0, 6), cut(v, 0, 6), key_valid=mask(0, 6))
    outs.append(out)
    for i in range(6, 11):  # token by token: the merged state
        out, state = layer(cut(q, i, i + 1), cut(k, i, i + 1), cut(v, i, i + 1), state=state, key_valid=mask(i, i + 1))
        assert state.merged is not None
        outs.append(out)
    out, state = layer(cut(q, 11, 17), cut(k, 11, 17), cut(v, 11, 17), state=state, key_valid=mask(11, 17))
    outs.append(out)  # a chunked call after decoding: the merged state split into blocks
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-5, atol=1e-6)
    assert state.length == 17


@torch.no_grad()
def test_the_merged_state_splits_into_the_per_block_states_and_keeps_its_size():
    layer = _layer(gate=False)
    q, k, v = _inputs(9)
    _, state = layer(q, k, v)
    blocks = state.per_block()
    merged = BlockState(state.layout, blocks).merge()
    assert merged.kv.shape == (2, HEADS, max(DIMS), D)
    for mine, back in zip(blocks, BlockState(state.layout, merged=merged).per_block()):
        assert torch.equal(mine.kv, back.kv) and torch.equal(mine.k_sum, back.k_sum)
        assert torch.equal(mine.offset, back.offset) and mine.length == back.length
    step = [x[:, :, :1] for x in (q, k, v)]
    _, first = layer(*step, state=state)
    _, second = layer(*step, state=first)
    assert first.nbytes() == second.nbytes()
    picked = second.index_select(torch.tensor([1, 0]))
    assert torch.equal(picked.merged.kv[0], second.merged.kv[1]) and picked.length == second.length


@torch.no_grad()
def test_decoding_follows_a_parameter_update():
    """The PRF blocks' merged map is kept between decoding steps; an in-place update of the
    parameters (an optimiser step) must be seen by the next step."""
    layer = _layer(gate=False)
    q, k, v = _inputs(8)
    _, state = layer(q[:, :, :7], k[:, :, :7], v[:, :, :7])
    layer(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], state=state)  # the merged map is now kept
    for p in layer.feature_map.parameters():
        p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    _, state = layer(q[:, :, :7], k[:, :, :7], v[:, :, :7])
    out, _ = layer(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], state=state)
    full, _ = layer(q, k, v)
    torch.testing.assert_close(out, full[:, :, 7:], rtol=1e-5, atol=1e-6)
