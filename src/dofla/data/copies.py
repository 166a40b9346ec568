"""Far copies in the distillation text (``distill.copy_share``): recall for the student to learn.

Natural text rarely asks a model to recall an exact string from hundreds of tokens back, so a KL to
the teacher on it barely teaches a windowed or linear student to do so (passkey stays at 0). Here a
share of each sequence's tokens is overwritten with spans of 8–32 tokens copied from at least
``distance`` tokens earlier in the same sequence. The teacher, an induction-capable softmax model,
predicts the rest of a span once it has seen its start; the KL then asks the student to do the same
from beyond its window. The text stays the teacher's own, only rearranged: no labels, no new tokens.
"""
from __future__ import annotations

import math

import torch

SPAN = (8, 32)  # span lengths, inclusive


def plant_copies(row: torch.Tensor, share: float, distance: int, gen: torch.Generator) -> list[tuple[int, int, int]]:
    """Overwrite spans of ``row`` (L,) in place with copies of earlier text, about ``share`` of its
    tokens in all; returns the (source, destination, length) of each copy.

    Each destination starts at least ``distance`` tokens after its source ends, no two destinations
    overlap, and they are written from left to right, so a span copied from text that an earlier copy
    overwrote copies what the sequence now shows there: every copy is an exact repeat of visible text.
    """
    length = row.shape[0]
    lo, hi = SPAN
    if length < distance + 2 * lo:
        raise ValueError(f"far copies need sequences of at least {distance + 2 * lo} tokens (distance {distance} "
                         f"plus two {lo}-token spans), not {length}")
    budget, taken, planned = math.ceil(share * length), torch.zeros(length, dtype=torch.bool), []
    longest = min(hi, (length - distance) // 2)  # a span and its copy, `distance` apart, fit the row
    for _ in range(16 * budget // lo + 16):  # attempts; a crowded row may end short of its share
        if budget <= 0:
            break
        span = int(torch.randint(lo, longest + 1, (1,), generator=gen))
        dest = int(torch.randint(distance + span, length - span + 1, (1,), generator=gen))
        if taken[dest:dest + span].any():
            continue
        source = int(torch.randint(0, dest - distance - span + 1, (1,), generator=gen))
        taken[dest:dest + span] = True
        planned.append((source, dest, span))
        budget -= span
    planned.sort(key=lambda c: c[1])
    for source, dest, span in planned:
        row[dest:dest + span] = row[source:source + span].clone()
    return planned


class CopySpans:
    """A batch stream (``next_batch()``, ``state()``, ``restore()``, ``batch_tokens``) whose batches
    carry far copies (:func:`plant_copies`, ``share`` of every row's tokens). The copies of batch n
    depend only on ``seed`` and n, so a resumed run, and every rank under torchrun, plants the same."""

    def __init__(self, stream, share: float, distance: int, seed: int = 0):
        self.stream, self.share, self.distance, self.seed = stream, share, distance, seed
        self.served = 0

    def __getattr__(self, name):  # batch_tokens, seq_len, source, ...: the wrapped stream's
        if name == "stream":
            raise AttributeError(name)
        return getattr(self.stream, name)

    def next_batch(self) -> torch.Tensor:
        batch = self.stream.next_batch().clone()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.served)
        for row in batch:
            plant_copies(row, self.share, self.distance, gen)
        self.served += 1
        return batch

    def state(self) -> dict:
        return {"stream": self.stream.state(), "copy_batches": self.served}

    def restore(self, state: dict) -> None:
        self.stream.restore(state["stream"])
        self.served = state["copy_batches"]
