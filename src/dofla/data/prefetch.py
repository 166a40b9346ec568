"""Batches read ahead by a worker thread, off the training step's critical path.

:class:`Prefetcher` wraps a batch stream (``BatchStream`` over text, ``TokenStream`` over prepared
tokens): while the training step runs, a worker thread reads and tokenises the next ``depth``
batches (fast tokenizers and memory-mapped reads release the GIL). It serves the same batches,
states and errors as the stream itself, in the same order: ``state()`` is the state after the
last batch *served*, never after one only read ahead, so a checkpoint taken between steps resumes
exactly where the step was. ``restore`` and ``discard`` stop the worker first; it restarts on the
next ``next_batch``.
"""
from __future__ import annotations

import copy
import queue
import threading

import torch

from dofla.data.stream import Batches


class Prefetcher(Batches):
    def __init__(self, stream, depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth={depth} must be ≥ 1 (no prefetcher: use the stream itself)")
        self.stream, self.depth = stream, depth
        self.source = getattr(stream, "source", "data")
        self.batch_size, self.seq_len, self.batch_tokens = stream.batch_size, stream.seq_len, stream.batch_tokens
        self._thread: threading.Thread | None = None
        self._sync()

    def _sync(self) -> None:
        """Served position and state from the (idle) stream itself."""
        self.position, self._state = self.stream.position, copy.deepcopy(self.stream.state())

    def _start(self) -> None:
        self._ahead: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        # the worker holds the stream, not the prefetcher, so a dropped prefetcher stops it (__del__)
        self._thread = threading.Thread(target=_read_ahead, args=(self.stream, self._ahead, self._stop),
                                        daemon=True, name="dofla-prefetch")
        self._thread.start()

    def close(self) -> None:
        """Stop the worker (batches it read ahead are dropped; ``state()`` is unchanged)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def next_batch(self) -> torch.LongTensor:
        if self._thread is None:
            self._start()
        batch, state, err = self._ahead.get()
        if err is not None:
            self.close()
            raise err
        self.position, self._state = self.position + 1, state
        return batch

    def state(self) -> dict:
        return copy.deepcopy(self._state)

    def restore(self, state: dict) -> None:
        self.close()
        self.stream.restore(state)
        self._sync()

    def discard(self, num_tokens: int) -> None:
        self._rewind()
        self.stream.discard(num_tokens)
        self._sync()

    def skip_to(self, batch: int) -> None:
        self.close()
        self.stream.skip_to(batch)
        self._sync()

    def _rewind(self) -> None:
        """Stop the worker and put the stream back where the last served batch left it."""
        if self._thread is not None:
            self.close()
            self.stream.restore(self._state)

    def __del__(self):  # a dropped prefetcher must not leave its worker reading
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _read_ahead(stream, ahead: queue.Queue, stop: threading.Event) -> None:
    """The worker: (batch, state after it, None) into ``ahead`` until stopped; an error ends it as
    (None, None, error), which the consumer raises when it reaches that batch."""
    while not stop.is_set():
        try:
            item = (stream.next_batch(), copy.deepcopy(stream.state()), None)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, in order
            item = (None, None, err)
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if item[2] is not None:
            return


def prefetched(stream, depth: int):
    """``stream`` read ahead by ``depth`` batches (``depth`` 0: the stream itself)."""
    return Prefetcher(stream, depth) if depth > 0 else stream
