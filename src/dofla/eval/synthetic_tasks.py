"""lm-eval tasks that build their own documents (RULER's needle tasks), at the lengths a model reaches.

A RULER task generates its prompts with the model's tokenizer, sized to each length in lm-eval's
``max_seq_lengths`` metadata, and reports one metric per length (``"1024"``, ``"2048"``, ...). lm-eval
takes a tokenizer by name only, so the tokenizer in memory is saved to a temporary folder and named by
its path. Each length runs on its own: lm-eval's ``limit`` takes the first documents of the whole
generated split, which holds the shortest length's documents first, so one run with a limit would
score the shortest length alone.
"""
from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

# RULER's lengths from 1K up (lm-eval's default is 4096 alone); a model runs those within its context.
RULER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def reachable_lengths(max_length: int, lengths: Sequence[int] | None = None) -> list[int]:
    """The lengths (``RULER_LENGTHS`` when none are given) that fit the model's context: a RULER
    sample of length L holds its prompt and the 128 generated tokens within L."""
    return [n for n in (RULER_LENGTHS if lengths is None else lengths) if n <= max_length]


@contextlib.contextmanager
def saved_tokenizer(tokenizer) -> Iterator[str]:
    """A folder holding ``tokenizer`` (``save_pretrained``), for lm-eval's generators to load by name."""
    with tempfile.TemporaryDirectory(prefix="dofla-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        yield folder


def length_manager(yaml_path: Path, tokenizer_dir: str, length: int):
    """A TaskManager over the task's own YAML folder (a few files, indexed in well under a second)
    whose tasks generate their documents at ``length`` with the saved tokenizer."""
    from lm_eval.tasks import TaskManager  # lazy: lm-eval (the eval extra) takes seconds to import

    return TaskManager(include_path=[str(Path(yaml_path).parent)], include_defaults=False,
                       metadata={"tokenizer": tokenizer_dir, "max_seq_lengths": [length]})


def length_metrics(row: dict) -> dict:
    """The row without RULER's ``-1`` for a length it generated no documents at (its
    ``aggregate_metrics`` marks an empty length so; a score lies in [0, 1])."""
    return {k: v for k, v in row.items() if not (k.split(",")[0].isdigit() and v == -1)}
