"""Hugging Face hub datasets: the paper's Wikipedia and WikiText-103, and FineWeb-Edu.

All three stream (``datasets`` streaming mode): documents arrive as they are read, nothing is
materialised, so streaming distillation (``dofla.data.stream``) can run over billions of tokens.
Real loading code for users with network access or a filled HF cache. Offline, a load fails in a
few seconds with one sentence naming the dataset and the fix, never deep inside ``datasets``.
"""
from __future__ import annotations

from contextlib import nullcontext
import zlib
from typing import Iterator

from dofla.data.sources import DATA_SOURCES, DataError, DataSource, _check_split
from dofla.hub import forced_offline, hub_offline, hub_reachable


def load_hub_dataset(path: str, name: str | None, split: str, streaming: bool = True):
    """``datasets.load_dataset`` that uses only the local HF cache when the hub is unreachable,
    failing within seconds with one sentence instead of retrying for minutes."""
    import datasets

    label = f"{path} ({name})" if name else path
    reachable = hub_reachable()
    try:
        with nullcontext() if reachable else forced_offline():
            return datasets.load_dataset(path, name, split=split, streaming=streaming)
    except Exception as err:  # datasets raises many types; all mean "not available"
        if not reachable:
            why = ("offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if hub_offline()
                   else "no network or hub access")
            raise DataError(
                f"could not download {label}: {why} and it is not in the local HF cache; "
                "pre-download it with network access (then HF_DATASETS_OFFLINE=1 works), "
                "or use data=embedded / data=text_files"
            ) from None
        raise DataError(f"could not load {label}: {type(err).__name__}: {err}") from None


@DATA_SOURCES.register("wikipedia")
class Wikipedia(DataSource):
    """A seeded random fraction of English Wikipedia (wikimedia/wikipedia, 20231101.en)."""

    name = "wikipedia"
    path, config = "wikimedia/wikipedia", "20231101.en"

    def __init__(self, fraction: float = 0.1, seed: int = 0, heldout_every: int = 1000):
        if not 0 < fraction <= 1:
            raise DataError(f"data.options.fraction={fraction} must be in (0, 1]")
        self.fraction, self.seed, self.heldout_every = fraction, seed, heldout_every

    def _keep(self, index: int) -> bool:
        # a hash of (seed, index) picks the random fraction without materialising the dataset
        return (zlib.crc32(f"{self.seed}:{index}".encode()) % 1_000_000) < self.fraction * 1_000_000

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        rows = load_hub_dataset(self.path, self.config, "train")
        for i, row in enumerate(rows):
            if self._keep(i) and ((i % self.heldout_every == 0) == (split == "heldout")):
                yield row["text"]

    def fingerprint(self) -> str:
        return f"wikipedia-{self.config}-f{self.fraction}-s{self.seed}-h{self.heldout_every}"


@DATA_SOURCES.register("wikitext103")
class WikiText103(DataSource):
    """WikiText-103 (raw): train split for distillation, validation split held out."""

    name = "wikitext103"
    path, config = "Salesforce/wikitext", "wikitext-103-raw-v1"

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        rows = load_hub_dataset(self.path, self.config, "train" if split == "train" else "validation")
        for row in rows:
            if row["text"].strip():
                yield row["text"]

    def fingerprint(self) -> str:
        return f"wikitext103-{self.config}"


@DATA_SOURCES.register("fineweb_edu")
class FineWebEdu(DataSource):
    """FineWeb-Edu (HuggingFaceFW/fineweb-edu), a ``sample-*`` subset, streamed in its stored order;
    every ``heldout_every``-th document is held out, as for Wikipedia (the dataset has one split)."""

    name = "fineweb_edu"
    path = "HuggingFaceFW/fineweb-edu"

    def __init__(self, subset: str = "sample-10BT", heldout_every: int = 1000, min_int_score: int = 0):
        if heldout_every < 2:
            raise DataError(f"data.options.heldout_every={heldout_every} must be ≥ 2")
        self.subset, self.heldout_every, self.min_int_score = subset, heldout_every, min_int_score

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        rows = load_hub_dataset(self.path, self.subset, "train")
        for i, row in enumerate(rows):
            # the split is decided by index before the score filter: raising it keeps the splits apart
            if (i % self.heldout_every == 0) == (split == "heldout") and row.get("int_score", 5) >= self.min_int_score:
                yield row["text"]

    def fingerprint(self) -> str:
        return f"fineweb_edu-{self.subset}-h{self.heldout_every}-s{self.min_int_score}"
