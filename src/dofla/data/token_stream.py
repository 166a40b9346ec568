"""Batches of prepared training tokens (:class:`TokenStream`): ``BatchStream``'s interface over a
:class:`~dofla.data.prepared.PreparedTokens` directory, with O(1) resume and, when asked, more passes over
the text it has served."""
from __future__ import annotations

import logging

import numpy as np
import torch

from dofla.data.sources import DataError
from dofla.data.stream import Batches, StreamExhausted

logger = logging.getLogger(__name__)


class TokenStream(Batches):
    """``BatchStream``'s interface over prepared tokens: the same batches, O(1) resume.

    ``passes`` > 1: when the split runs out, the stream serves the batches it served so far again, each
    further pass in its own random order (of ``seed`` and the pass), so a stage asked for more tokens than
    the split holds reads its own text again and never the text skipped before its first batch (another
    stage's, or a cached sample held out from training)."""

    def __init__(self, prepared, batch_size: int, seq_len: int, passes: int = 1, seed: int = 0):
        """``prepared``: a :class:`~dofla.data.prepared.PreparedTokens` (its ``slice``, ``available``, ``name``)."""
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"streaming needs batch_size ≥ 1 and seq_len ≥ 1, got {batch_size} and {seq_len}")
        self.prepared, self.source = prepared, prepared.name
        self.batch_size, self.seq_len, self.batch_tokens = batch_size, seq_len, batch_size * seq_len
        self.passes, self.seed = passes, seed
        self.position, self.offset = 0, 0  # batches served, tokens consumed (served or discarded)
        # beyond the first pass: the pass, the batches served in it, where the first pass's batches start
        # and how many it served
        self.pass_index, self.in_pass, self.start, self.count = 0, 0, 0, 0

    def state(self) -> dict:
        state = {"position": self.position, "tokens": self.offset}
        if self.pass_index:  # a first pass's state is the single-pass stream's
            state.update({"pass": self.pass_index, "in_pass": self.in_pass, "start": self.start, "count": self.count})
        return state

    def restore(self, state: dict) -> None:
        if "tokens" not in state:
            raise DataError("this checkpoint was written by a text stream of an older dofla, which prepared "
                            "data cannot resume; set data.prepared=off to resume it")
        self.position, self.offset = state["position"], state["tokens"]
        self.pass_index, self.in_pass = state.get("pass", 0), state.get("in_pass", 0)
        self.start, self.count = state.get("start", 0), state.get("count", 0)

    def skip_to(self, batch: int) -> None:
        self.restore({"position": 0, "tokens": 0})
        first = batch if self.passes == 1 else min(batch, self.prepared.available("train") // self.batch_tokens)
        self.position, self.offset = first, first * self.batch_tokens
        for _ in range(batch - first):  # into a later pass
            self._advance()
            self.position += 1

    def discard(self, num_tokens: int) -> None:
        self._check(num_tokens)
        self.offset += num_tokens

    def next_batch(self) -> torch.LongTensor:
        at = self._advance()
        batch = self.prepared.slice("train", at, self.batch_tokens, "data.num_tokens")
        self.position += 1
        return batch.view(self.batch_size, self.seq_len)

    def _advance(self) -> int:
        """The next batch's first token (the pass moved on when the last one ended); StreamExhausted past
        the last pass."""
        if self.pass_index == 0:
            if self.passes == 1 or self.offset + self.batch_tokens <= self.prepared.available("train"):
                self._check(self.batch_tokens)
                self.offset += self.batch_tokens
                return self.offset - self.batch_tokens
            self.start, self.count = self.offset - self.position * self.batch_tokens, self.position
            self._next_pass()
        elif self.in_pass == self.count:
            self._next_pass()
        at = self.start + int(self._order()[self.in_pass]) * self.batch_tokens
        self.in_pass += 1
        return at

    def _next_pass(self) -> None:
        if self.pass_index + 1 >= self.passes or self.count == 0:
            served = self.position * self.batch_tokens
            raise StreamExhausted(
                f"prepared data {self.source!r} ran out after {served} tokens ({self.position} batches of "
                f"{self.batch_size}×{self.seq_len}, {self.pass_index + 1} of {self.passes} passes); request "
                "fewer tokens or prepare more", served)
        self.pass_index, self.in_pass = self.pass_index + 1, 0
        logger.info(f"dofla: pass {self.pass_index} of {self.passes} over the {self.count * self.batch_tokens:,} "
                    f"training tokens read so far ({self.count} batches of {self.batch_size}×{self.seq_len}) begins, "
                    "in another order")

    def _order(self) -> np.ndarray:
        """The first pass's batches in the current pass's order."""
        return np.random.default_rng([self.seed, self.pass_index]).permutation(self.count)

    def _check(self, num_tokens: int) -> None:
        if self.offset + num_tokens > self.prepared.available("train"):
            served = self.position * self.batch_tokens
            raise StreamExhausted(
                f"prepared data {self.source!r} ran out after {served} tokens ({self.position} batches of "
                f"{self.batch_size}×{self.seq_len}); request fewer tokens or prepare more", served)
