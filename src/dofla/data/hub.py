"""Hugging Face hub datasets: the paper's Wikipedia and WikiText-103, and FineWeb-Edu; local Parquet.

All three stream (``datasets`` streaming mode): documents arrive as they are read, nothing is
materialised, so streaming distillation (``dofla.data.stream``) can run over billions of tokens.
Real loading code for users with network access or a filled HF cache. Offline, a load fails in a
few seconds with one sentence naming the dataset and the fix, never deep inside ``datasets``.
"""
from __future__ import annotations

from contextlib import nullcontext
import zlib
from pathlib import Path
from typing import Iterator

from dofla.data.sources import DATA_SOURCES, DataError, DataSource, _check_split, files_fingerprint
from dofla.hub import forced_offline, hub_offline, hub_reachable


def load_hub_dataset(path: str, name: str | None, split: str, streaming: bool = True):
    """``datasets.load_dataset`` that uses only the local HF cache when the hub is unreachable,
    failing within seconds with one sentence instead of retrying for minutes."""
    import datasets  # lazy: datasets (hub data only) takes seconds to import

    label = f"{path} ({name})" if name else path
    reachable = hub_reachable()
    try:
        with nullcontext() if reachable else forced_offline():
            return datasets.load_dataset(path, name, split=split, streaming=streaming)
    except Exception as err:  # datasets raises many types; all mean "not available"
        if not reachable:
            why = ("offline mode is set (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE or HF_DATASETS_OFFLINE)" if hub_offline()
                   else "no network or hub access")
            raise DataError(
                f"could not download {label}: {why} and it is not in the local HF cache; "
                "pre-download it with network access (then HF_DATASETS_OFFLINE=1 works), "
                "or use data=embedded / data=text_files"
            ) from None
        raise DataError(f"could not load {label}: {type(err).__name__}: {err}") from None


def parquet_rows(paths: list[Path], column: str) -> Iterator[dict]:
    """``{column: value}`` for every row of the Parquet files, in file and row order, read in batches."""
    import pyarrow.parquet as pq  # lazy: only for parquet files

    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(columns=[column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield {column: value}


def check_parquet(paths: list[str], column: str, setting: str) -> list[Path]:
    """The files as Paths, each an existing Parquet file with ``column``; one sentence when not."""
    import pyarrow.parquet as pq  # lazy: only for parquet files

    out = [Path(p).expanduser() for p in ([paths] if isinstance(paths, str) else paths)]
    if not out:
        raise DataError(f"{setting} names no files; list the .parquet files")
    for path in out:
        if not path.is_file():
            raise DataError(f"Parquet file {path} does not exist; fix {setting}")
        try:
            names = pq.read_schema(path).names
        except Exception as err:  # pyarrow's errors for a non-Parquet file vary by version
            raise DataError(f"{path} is not a readable Parquet file ({type(err).__name__}); fix {setting}") from None
        if column not in names:
            raise DataError(f"Parquet file {path} has no {column!r} column (it has {', '.join(names)}); "
                            "set data.options.text_field")
    return out


@DATA_SOURCES.register("wikipedia")
class Wikipedia(DataSource):
    """A seeded random fraction of English Wikipedia (wikimedia/wikipedia, 20231101.en), from the hub, or
    from local copies of that dataset's Parquet files (``files``, in the dataset's order: the same
    articles are kept, so the same subset on a cluster without the hub)."""

    name = "wikipedia"
    path, config = "wikimedia/wikipedia", "20231101.en"

    def __init__(self, fraction: float = 0.1, seed: int = 0, heldout_every: int = 1000, files: list[str] | None = None):
        if not 0 < fraction <= 1:
            raise DataError(f"data.options.fraction={fraction} must be in (0, 1]")
        self.fraction, self.seed, self.heldout_every = fraction, seed, heldout_every
        self.files = list(files or [])

    def check(self) -> None:
        if self.files:
            check_parquet(self.files, "text", "data.options.files")

    def _keep(self, index: int) -> bool:
        # a hash of (seed, index) picks the random fraction without materialising the dataset
        return (zlib.crc32(f"{self.seed}:{index}".encode()) % 1_000_000) < self.fraction * 1_000_000

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        rows = parquet_rows([Path(f).expanduser() for f in self.files], "text") if self.files else \
            load_hub_dataset(self.path, self.config, "train")
        for i, row in enumerate(rows):
            if self._keep(i) and ((i % self.heldout_every == 0) == (split == "heldout")):
                yield row["text"]

    def fingerprint(self) -> str:
        local = ""
        if self.files:  # local copies: named in the key (the same files give the hub's subset, but are checked apart)
            local = "-files" + zlib.crc32(repr([(Path(f).name, Path(f).expanduser().stat().st_size)
                                                for f in self.files]).encode()).to_bytes(4, "big").hex()
        return f"wikipedia-{self.config}-f{self.fraction}-s{self.seed}-h{self.heldout_every}{local}"


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


@DATA_SOURCES.register("parquet")
class Parquet(DataSource):
    """Local Parquet files (a downloaded hub dataset, a cluster's shared copy), one document per row of
    ``text_field``, in file and row order; every ``heldout_every``-th row is held out."""

    name = "parquet"

    def __init__(self, paths: list[str] | str = (), text_field: str = "text", heldout_every: int = 1000):
        if heldout_every < 2:
            raise DataError(f"data.options.heldout_every={heldout_every} must be ≥ 2")
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.text_field, self.heldout_every = text_field, heldout_every

    def check(self) -> None:
        check_parquet(self.paths, self.text_field, "data.options.paths")

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        for i, row in enumerate(parquet_rows([Path(p).expanduser() for p in self.paths], self.text_field)):
            if (i % self.heldout_every == 0) == (split == "heldout"):
                yield row[self.text_field]

    def fingerprint(self) -> str:
        return files_fingerprint("parquet", self.paths, f"{self.text_field}-{self.heldout_every}")
