"""On a GPU the stabiliser decides its fast path for all blocks at once: the same decision as block
by block, with one host synchronisation per kernel call instead of one per chunk. On the CPU it
decides block by block (cheaper there); ``stable.AHEAD_ON_CPU`` runs the device path here.

Host synchronisations are counted on the CPU with a TorchFunctionMode that records every tensor
method that must read a value on the host (``bool``, ``item``, ``tolist``, ``nonzero``, ...), with the
source line that asked, so the count is of dofla's own requests (transformers' mask code asks once
per forward by itself).
"""
from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dofla
from dofla.attention import hybrid_attention_chunked, linear_attention_chunked
from dofla.attention.linear import LinearState, _chunk_decay, _chunk_flags
from dofla.attention import stable
from dofla.attention.stable import fast_path_flags, stable_block
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train.losses import softmax_loss

SYNCS = {"__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__"}
DOFLA = str(Path(dofla.__file__).parent)


class HostSyncs(TorchFunctionMode):
    """Counts, per (file, line) inside dofla, the tensor calls that wait for a value on the host."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            caller = traceback.extract_stack(limit=2)[0]
            if caller.filename.startswith(DOFLA):
                self.calls[(Path(caller.filename).name, caller.lineno)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setattr(stable, "AHEAD_ON_CPU", True)


def _inputs(t: int, seed: int, jumps: int = 3, m: int = 8):
    """log_q, log_k (2, 2, T, M): random, with key feature 0 raised at a few positions by 100, 200, ...
    nats (each above everything before it), so that the blocks holding a jump after their first key
    leave the fast path (that key dwarfs the first) and the others do not."""
    g = torch.Generator().manual_seed(seed)
    log_q, log_k = (torch.randn(2, 2, t, m, generator=g) for _ in range(2))
    if t > 1 and jumps:
        for i, pos in enumerate(sorted(torch.randint(1, t, (jumps,), generator=g).tolist())):
            log_k[:, :, pos, 0] += 100.0 * (i + 1)
    return log_q, log_k


def _slab_decisions(log_q, log_k, block: int, lag: int) -> list[bool]:
    """stable_block's own fast-path decision (one synchronisation each), block by block."""
    b, h, length, m = log_q.shape
    floor = log_q.new_full((b, h, m), torch.finfo(log_q.dtype).min)
    out = []
    for start in range(0, max(0, length - lag), block):
        lk = log_k[:, :, start:start + block]
        diag = min(lk.shape[2], length - start - lag)
        rows = log_q[:, :, start + lag:start + lag + diag]
        out.append(stable_block(rows, lk, torch.arange(1, diag + 1), floor, first_sees=True).direct)
    return out


@pytest.mark.parametrize("length,block,lag", [(1, 16, 0), (37, 16, 0), (130, 64, 0), (130, 16, 5), (64, 16, 40)])
def test_the_flags_of_all_loss_blocks_are_the_block_by_block_decisions(length, block, lag):
    seen = set()
    for seed in range(6):
        log_q, log_k = _inputs(length, seed)
        expected = _slab_decisions(log_q, log_k, block, lag)
        assert fast_path_flags(log_q, log_k, block, lag) == expected
        seen.update(expected)
    if length > block:
        assert seen == {True, False}  # both paths were exercised


def _chunk_decisions(log_q, log_k, decay, state: LinearState, chunk: int) -> list[bool]:
    """The chunked kernel's loop, deciding each chunk on the host (the pre-computation's reference)."""
    offset, out = state.offset, []
    for start in range(0, log_q.shape[2], chunk):
        lq, lk = log_q[:, :, start:start + chunk], log_k[:, :, start:start + chunk]
        if decay is not None:
            d = decay[:, :, start:start + chunk]
            lq, lk = lq + d, lk - d
        blk = stable_block(lq, lk, torch.arange(1, lk.shape[2] + 1), offset, first_sees=True)
        out.append(blk.direct)
        offset = blk.offset if decay is None else blk.offset + d[:, :, -1]
    return out


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("length,chunk", [(1, 8), (45, 8), (130, 32)])
def test_the_flags_of_all_chunks_are_the_chunk_by_chunk_decisions(gated, length, chunk):
    seen = set()
    for seed in range(6):
        log_q, log_k = _inputs(length, seed)
        prior, prior_k = _inputs(20, seed + 100, jumps=0)  # a carried state
        _, state = linear_attention_chunked(prior, prior_k, torch.randn(2, 2, 20, 3), chunk_size=chunk)
        g = torch.Generator().manual_seed(seed)
        decay = _chunk_decay(-torch.rand(2, 2, length, generator=g) * 3, chunk) if gated else None
        expected = _chunk_decisions(log_q, log_k, decay, state, chunk)
        assert _chunk_flags(log_q, log_k, decay, state.offset, chunk) == expected
        seen.update(expected)
    if length > chunk:
        assert seen == {True, False}


@pytest.mark.parametrize("gated", [False, True])
def test_the_chunked_kernel_synchronises_once_per_call(ahead, gated):
    log_q, log_k = (x.requires_grad_() for x in _inputs(300, 0, jumps=0))  # the fast path throughout
    v = torch.randn(2, 2, 300, 4)
    decay = -torch.rand(2, 2, 300) if gated else None
    with HostSyncs() as syncs:
        out, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=32, log_decay=decay)
        out.sum().backward()
    assert syncs.total == 1, syncs.calls  # 10 chunks


def test_the_softmax_loss_synchronises_once_per_call(ahead):
    log_q, log_k = (x.requires_grad_() for x in _inputs(300, 1, jumps=0))
    q, k = torch.randn(2, 2, 300, 4), torch.randn(2, 2, 300, 4)
    with HostSyncs() as syncs:
        softmax_loss(log_q, log_k, q, k).backward()
    assert syncs.total == 1, syncs.calls  # 3 blocks of 128 keys


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_a_linear_student_forward_and_backward_synchronise_once_per_layer(ahead, gate):
    student = convert(build_tiny_model("llama", seed=0), feature_map="hedgehog", dims=[16, 16], chunk_size=8,
                      gate=gate)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as syncs:
        student(input_ids=ids, use_cache=False).logits.pow(2).mean().backward()
    assert syncs.total == 2, syncs.calls  # two layers, five chunks each


def test_a_hybrid_knows_where_its_rows_start_seeing_linear_keys():
    """The hybrid still decides its fast path chunk by chunk (one synchronisation per chunk that has
    linear keys), but no longer asks the device whether a chunk's first row sees a linear key: that
    follows from the window and the chunk's position."""
    g = torch.Generator().manual_seed(2)
    q, k, v, log_q, log_k = (torch.randn(2, 2, 40, 4, generator=g) for _ in range(5))
    with HostSyncs() as syncs:
        hybrid_attention_chunked(q, k, v, log_q, log_k, window=8)
    stabiliser = sum(n for (name, _), n in syncs.calls.items() if name == "stable.py")
    assert stabiliser == 4, syncs.calls  # chunks 2-5 of 8 tokens have keys that left the window


@pytest.mark.parametrize("gated", [False, True])
def test_deciding_ahead_computes_exactly_what_deciding_block_by_block_does(monkeypatch, gated):
    """Outputs and gradients of the chunked kernel and the softmax loss, with blocks on both paths."""
    def run():
        log_q, log_k = (x.requires_grad_() for x in _inputs(150, 3))
        decay = (-torch.rand(2, 2, 150, generator=torch.Generator().manual_seed(4))).requires_grad_() if gated else None
        v = torch.randn(2, 2, 150, 4, generator=torch.Generator().manual_seed(5))
        with HostSyncs() as syncs:
            out, _ = linear_attention_chunked(log_q, log_k, v, chunk_size=16, log_decay=decay)
            loss = out.pow(2).sum() + softmax_loss(log_q, log_k, v, v)
        loss.backward()
        grads = [x.grad for x in (log_q, log_k, decay) if x is not None]
        return out, loss, grads, syncs.total

    out, loss, grads, per_block = run()
    monkeypatch.setattr(stable, "AHEAD_ON_CPU", True)
    out_ahead, loss_ahead, grads_ahead, ahead_syncs = run()
    assert torch.equal(out, out_ahead) and torch.equal(loss, loss_ahead)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ahead))
    assert ahead_syncs < per_block


def test_a_hybrid_reads_the_host_for_its_sinks_only_until_every_row_holds_them():
    g = torch.Generator().manual_seed(3)
    q, k, v, log_q, log_k = (torch.randn(2, 2, 48, 4, generator=g) for _ in range(5))
    with HostSyncs() as syncs:
        out, state = hybrid_attention_chunked(q, k, v, log_q, log_k, window=8, sinks=2)
    bookkeeping = sum(n for (name, _), n in syncs.calls.items() if name == "hybrid.py")
    assert bookkeeping == 1, syncs.calls  # the second chunk's sinks leave the window; six chunks
    assert state.sinks_held and state.sink_valid.all() and state.sink_k.shape[2] == 2
    valid = torch.ones(2, 48, dtype=torch.bool)
    valid[1, :42] = False  # this row's sinks (keys 42, 43) are still in the window at the end
    _, padded = hybrid_attention_chunked(q, k, v, log_q, log_k, window=8, sinks=2, key_valid=valid)
    assert not padded.sinks_held
