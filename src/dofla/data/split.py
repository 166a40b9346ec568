"""The held-out text's two parts, dev and test, and the setting that picks the one a run scores.

The held-out text is a data source's held-out documents joined by EOS, exactly as the training text is
(for the embedded corpus under the headline's ``data.options.heldout_every=10``: every 10th KJV chapter,
119 chapters, 98,029 tokens with the SmolLM2 tokenizer, EOS included). ``data.heldout_split`` picks the
part every evaluation of the run scores:

- ``dev`` (the default): the first ``data.heldout_tokens`` held-out tokens (and the first
  ``eval.long_context_seqs`` long sequences), what every run scored before the split existed; it may
  not reach past ``data.test_start``.
- ``test``: the held-out tokens from ``data.test_start`` on: the first ``data.test_tokens`` of them
  (None: all, in whole sequences of ``data.seq_len``) and the first long sequences. ``data.heldout_tokens``
  does not size it: that setting is in the keys of streamed layers, so a test run keeps the dev run's
  value and shares its trained layers and student.

``data.test_start`` is 65,536 because that is where every recorded run's held-out reading ended: the
perplexity on 128 x 512 tokens and the loss by position on 32 x 2,048, both from the first held-out
token. The boundary is a token, not a chapter, so that the test part is exactly what no record scored.
With the embedded corpus it falls inside Lamentations 4: dev runs from Genesis 1 to there, test from
there through Ezekiel to Malachi (8,800 tokens) and Matthew 2 to Revelation 14 (23,400): 32,493 tokens,
63 sequences of 512 or 15 of 2,048. The test part is read from the prepared tokens (``dofla-prepare``;
the embedded corpus prepares itself), where token positions are known without tokenising again.
"""
from __future__ import annotations

from dofla.data.prepared import PreparedTokens
from dofla.data.sources import DataError

HELDOUT_SPLITS = ("dev", "test")


def heldout_range(data, need: int) -> tuple[int, int | None]:
    """[start, end) of the held-out token positions a run reads when it needs ``need`` tokens of its
    part (end None: to the end, a test run with ``data.test_tokens`` None)."""
    if data.heldout_split != "test":
        return 0, need
    return data.test_start, None if data.test_tokens is None else data.test_start + need


def check_heldout_split(data, need: int, setting: str) -> None:
    """One sentence unless the ``data`` settings name a part and a dev run stays inside the dev part.
    ``need``, ``setting``: the held-out tokens the run reads and the setting asking for them."""
    if data.heldout_split not in HELDOUT_SPLITS:
        raise DataError(f"data.heldout_split={data.heldout_split!r} must be one of {', '.join(HELDOUT_SPLITS)}")
    for name in ("test_start", "test_tokens"):
        value = getattr(data, name)
        if (value is not None or name == "test_start") and (not isinstance(value, int) or value < 1):
            raise DataError(f"data.{name}={value!r} must be a positive number of held-out tokens")
    if data.heldout_split == "dev" and need > data.test_start:
        raise DataError(f"{setting} asks for {need:,} held-out tokens, past the dev part (the first "
                        f"data.test_start={data.test_start:,}) into the test part; lower {setting} or raise "
                        "data.test_start")


def test_part(prepared: PreparedTokens, data, need: int, setting: str) -> PreparedTokens:
    """``prepared`` with its held-out split read from ``data.test_start`` on; one sentence when the
    whole held-out text is prepared and its test part holds fewer than ``need`` tokens."""
    part = prepared.heldout_from(data.test_start)
    have = part.available("heldout")
    if need > have and prepared.meta["heldout"]["complete"]:
        raise DataError(f"data.heldout_split=test scores the held-out tokens after the first "
                        f"data.test_start={data.test_start:,}, and data={prepared.name} holds {have:,} of them, "
                        f"fewer than the {need:,} {setting} asks for; lower {setting}")
    return part


def test_tokens(data, part: PreparedTokens) -> int:
    """The test tokens a run's held-out set scores: ``data.test_tokens``, else all in whole sequences."""
    return data.test_tokens or part.available("heldout") // data.seq_len * data.seq_len
