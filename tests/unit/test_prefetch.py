"""The prefetching worker (dofla.data.prefetch) against the plain stream it wraps: the same batches,
states and errors in the same order, with the worker reading ahead."""
from __future__ import annotations

import random
import time

import pytest
import torch

from dofla.data.prefetch import Prefetcher, prefetched
from dofla.data.stream import BatchStream, StreamExhausted
from dofla.models.tiny import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()


def texts(num_docs: int = 40) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice("to be or not that is the question".split()) for _ in range(rng.randint(3, 30)))
            for _ in range(num_docs)]


def plain(batch_size: int = 2, seq_len: int = 16, docs=None) -> BatchStream:
    docs = texts() if docs is None else docs
    return BatchStream(lambda: iter(docs), TOKENIZER, batch_size, seq_len, source="test")


def served(stream, n: int) -> list[tuple[torch.Tensor, dict]]:
    return [(stream.next_batch(), stream.state()) for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 3])
def test_the_same_batches_and_states_as_the_plain_stream(depth):
    reference = served(plain(), 8)
    fast = Prefetcher(plain(), depth)
    assert fast.state() == plain().state()  # before any batch: the stream's own start
    for (batch, state), (ref_batch, ref_state) in zip(served(fast, 8), reference):
        assert torch.equal(batch, ref_batch) and state == ref_state
    assert fast.position == 8
    fast.close()


def test_the_state_is_the_last_served_batch_not_the_last_read_ahead():
    fast = Prefetcher(plain(), depth=4)
    first = fast.next_batch()
    deadline = time.monotonic() + 5
    while fast.stream.position < 5 and time.monotonic() < deadline:  # the worker has read ahead
        time.sleep(0.01)
    assert fast.stream.position >= 5 and fast.position == 1  # the queue's 4 (and one waiting to go in)
    checkpoint = fast.state()
    assert checkpoint == served(plain(), 1)[0][1]
    later = served(fast, 3)
    resumed = Prefetcher(plain(), depth=4)  # a resume from the checkpoint continues exactly there
    resumed.restore(checkpoint)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(served(resumed, 3), later))
    assert not torch.equal(first, later[0][0])
    fast.close(), resumed.close()


def test_restore_and_discard_while_the_worker_runs():
    reference = served(plain(), 6)
    fast = Prefetcher(plain(), depth=2)
    served(fast, 4)
    fast.restore(reference[1][1])  # back to after batch 2
    assert torch.equal(fast.next_batch(), reference[2][0])
    other = plain()
    other.restore(reference[2][1])
    other.discard(5)
    fast.discard(5)  # relative to the served position, not to what the worker read
    assert torch.equal(fast.next_batch(), other.next_batch()) and fast.state() == other.state()
    fast.close()


def test_running_out_raises_at_the_same_batch_and_iteration_stops():
    docs = texts(6)
    count = 0
    ref = plain(docs=docs)
    with pytest.raises(StreamExhausted):
        while True:
            ref.next_batch()
            count += 1
    fast = Prefetcher(plain(docs=docs), depth=3)
    assert len(served(fast, count)) == count
    with pytest.raises(StreamExhausted, match="ran out of text"):
        fast.next_batch()
    assert len(list(Prefetcher(plain(docs=docs), depth=2))) == count
    assert prefetched(ref, 0) is ref and isinstance(prefetched(ref, 2), Prefetcher)


def test_a_dropped_prefetcher_stops_its_worker():
    import gc
    import threading

    fast = Prefetcher(plain(), depth=2)
    fast.next_batch()
    worker = fast._thread
    assert worker.is_alive()
    del fast
    gc.collect()
    worker.join(timeout=5)
    assert not worker.is_alive() and "dofla-prefetch" not in {t.name for t in threading.enumerate()}
