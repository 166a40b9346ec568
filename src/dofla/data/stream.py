"""A deterministic, resumable stream of (B, L) token batches for streaming distillation.

Documents are tokenised one at a time, joined by EOS and cut into L-token rows exactly as
``pack_tokens`` does, so the first n batches of a stream are the first n·B rows ``pack_tokens``
returns. Nothing is stored beyond one batch and the tail of the current document: the disk use
of a run does not grow with its token count.

Resume: ``state()`` is (batches served, documents read, leftover token ids). ``restore`` skips the
documents already read without tokenising them again, so resuming at batch n of a 362M-token run
costs one pass over the raw text iterator, not a re-tokenisation.
"""
from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator

import torch

from dofla.data.sources import DataError

_END = object()


class StreamExhausted(DataError):
    """The source has no more text; ``tokens`` says how many tokens it served in full batches."""

    def __init__(self, message: str, tokens: int):
        super().__init__(message)
        self.tokens = tokens


class Batches:
    """What every batch stream shares: iterating serves ``next_batch()`` until the text runs out."""

    def next_batch(self) -> torch.LongTensor:
        raise NotImplementedError

    def __iter__(self) -> Iterator[torch.LongTensor]:
        while True:
            try:
                yield self.next_batch()
            except StreamExhausted:
                return


class BatchStream(Batches):
    """Batches (B, L) of token ids from ``texts()``, a callable returning a fresh document iterator.

    ``texts`` must yield the same documents in the same order on every call (every registered
    data source does), which is what makes the stream deterministic and resumable.
    """

    def __init__(self, texts: Callable[[], Iterable[str]], tokenizer, batch_size: int, seq_len: int,
                 source: str = "data"):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"streaming needs batch_size ≥ 1 and seq_len ≥ 1, got {batch_size} and {seq_len}")
        self.texts, self.tokenizer, self.source = texts, tokenizer, source
        self.batch_size, self.seq_len = batch_size, seq_len
        self.batch_tokens = batch_size * seq_len
        self._reset()

    def _reset(self) -> None:
        self.position = 0  # batches served
        self._consumed = 0  # tokens served or discarded
        self._documents = 0  # documents read (tokenised) so far
        self._buffer: list[int] = []
        self._iterator: Iterator[str] | None = None

    def state(self) -> dict:
        """Everything needed to continue exactly here (small: one document's tail at most)."""
        return {"position": self.position, "documents": self._documents, "buffer": list(self._buffer),
                "tokens": self._consumed}

    def restore(self, state: dict) -> None:
        """Continue from a ``state()``: the next batch is the one that followed it. A prepared
        stream's state (tokens consumed, no document count) is replayed by tokenising the way there."""
        self._reset()
        if "documents" not in state:
            self.discard(state["tokens"])
            self.position = state["position"]
            return
        self.position, self._documents = state["position"], state["documents"]
        self._buffer = list(state["buffer"])
        self._consumed = state.get("tokens", 0)
        self._iterator = islice(iter(self.texts()), self._documents, None)

    def skip_to(self, batch: int) -> None:
        """Restart and serve batches until the next one is number ``batch`` (tokenises the way there)."""
        self._reset()
        for _ in range(batch):
            self.next_batch()

    def discard(self, num_tokens: int) -> None:
        """Drop the next ``num_tokens`` tokens unserved, e.g. the ones an activation cache already
        holds, so that cache's sequences stay held out from the stream (resumable like a batch)."""
        self._fill(num_tokens)
        del self._buffer[:num_tokens]
        self._consumed += num_tokens

    def next_batch(self) -> torch.LongTensor:
        """The next (B, L) batch; StreamExhausted (a DataError) when the text runs out."""
        self._fill(self.batch_tokens)
        batch = torch.tensor(self._buffer[: self.batch_tokens], dtype=torch.long)
        del self._buffer[: self.batch_tokens]
        self.position += 1
        self._consumed += self.batch_tokens
        return batch.view(self.batch_size, self.seq_len)

    def _fill(self, num_tokens: int) -> None:
        """Read documents until the buffer holds ``num_tokens`` ids; StreamExhausted if they run out."""
        if self._iterator is None:
            self._iterator = iter(self.texts())
        while len(self._buffer) < num_tokens:
            text = next(self._iterator, _END)
            if text is _END:
                served = self.position * self.batch_tokens
                raise StreamExhausted(
                    f"data source {self.source!r} ran out of text after {served} tokens "
                    f"({self.position} batches of {self.batch_size}×{self.seq_len}); "
                    "request fewer tokens or add data", served)
            self._documents += 1
            self._buffer.extend(self._tokenize(text))

    def _tokenize(self, text) -> list[int]:
        """One document's ids followed by EOS, as ``pack_tokens`` makes them."""
        if not isinstance(text, str):
            raise DataError(f"data source {self.source!r} gave document {self._documents} as "
                            f"{type(text).__name__}, not text; check its text field")
        if not text:
            return []
        ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return ids
