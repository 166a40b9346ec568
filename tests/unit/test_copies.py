"""Far copies in the distillation text (``distill.copy_share``): where they go, what they copy, and a
stream that plants the same ones again after a resume."""
from __future__ import annotations

import pytest
import torch

from dofla.data.copies import SPAN, CopySpans, plant_copies
from dofla.data.stream import BatchStream
from dofla.models.tiny import build_byte_tokenizer


def rows(n=3, length=512, seed=0):
    return torch.arange(n * length).view(n, length) + 1000 * seed  # every token distinct: copies are visible


@pytest.mark.parametrize("share, distance", [(0.1, 128), (0.3, 64), (0.25, 300)])
def test_copies_repeat_visible_text_from_far_back_at_about_the_share(share, distance):
    original = rows(1)[0]
    row = original.clone()
    copies = plant_copies(row, share, distance, torch.Generator().manual_seed(1))
    covered = torch.zeros(len(row), dtype=torch.bool)
    for source, dest, span in copies:
        assert SPAN[0] <= span <= SPAN[1] and dest >= source + span + distance  # from at least `distance` back
        assert not covered[dest:dest + span].any()  # destinations never overlap
        covered[dest:dest + span] = True
        assert torch.equal(row[dest:dest + span], row[source:source + span])  # an exact repeat of what is visible
    assert torch.equal(row[~covered], original[~covered])  # the rest of the text is untouched
    assert share * len(row) <= covered.sum() < share * len(row) + SPAN[1]


def test_a_copy_of_an_earlier_copy_repeats_the_text_now_shown():
    """Copies are written left to right, so a source inside an earlier destination copies that copy."""
    hits = 0
    for seed in range(40):
        row = rows(1)[0].clone()
        copies = plant_copies(row, 0.5, 32, torch.Generator().manual_seed(seed))
        for source, dest, span in copies:
            assert torch.equal(row[dest:dest + span], row[source:source + span])
            hits += any(d < source + span and source < d + s for _, d, s in copies if d < dest)
    assert hits > 0  # the case did occur


def test_too_short_a_row_is_refused_with_the_length_it_needs():
    with pytest.raises(ValueError, match="at least 144 tokens"):
        plant_copies(rows(1, 100)[0], 0.2, 128, torch.Generator())
    assert plant_copies(rows(1)[0], 0.0, 128, torch.Generator()) == []


def _stream():
    text = [" ".join(f"w{i}" for i in range(k, k + 400)) for k in range(0, 4000, 400)]
    return BatchStream(lambda: iter(text), build_byte_tokenizer(), 2, 256, source="test")


def test_the_stream_plants_the_same_copies_after_a_restore():
    plain, copied = _stream(), CopySpans(_stream(), 0.25, 64, seed=3)
    first = [copied.next_batch() for _ in range(2)]
    state = copied.state()
    after = [copied.next_batch() for _ in range(2)]
    reference = [plain.next_batch() for _ in range(4)]
    assert copied.batch_tokens == plain.batch_tokens == 512
    for got, text in zip(first + after, reference):
        changed = (got != text).float().mean().item()
        assert 0.1 < changed < 0.25 + SPAN[1] / 256  # about the share is rewritten (the last span may overrun)
    resumed = CopySpans(_stream(), 0.25, 64, seed=3)
    resumed.restore(state)
    assert all(torch.equal(a, b) for a, b in zip([resumed.next_batch() for _ in range(2)], after))
    other_seed = CopySpans(_stream(), 0.25, 64, seed=4)
    assert not torch.equal(other_seed.next_batch(), first[0])


def test_the_streams_own_tensor_is_not_written():
    """Prepared data serves views of its token file: planting copies must not write through them."""

    class Served:
        batch_tokens = 512

        def __init__(self):
            self.tokens = rows(2, 256)

        def next_batch(self):
            return self.tokens

    served = Served()
    batch = CopySpans(served, 0.25, 64).next_batch()
    assert torch.equal(served.tokens, rows(2, 256)) and not torch.equal(batch, served.tokens)
