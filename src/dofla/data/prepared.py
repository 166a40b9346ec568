"""Prepared data: a source tokenised once into flat token files that every run reads.

``dofla-prepare`` (or :func:`prepare`) reads a data source's train and held-out text once, joins the
documents by EOS exactly as :func:`~dofla.data.pack_tokens` does and writes the ids as two flat
arrays (``train.bin``, ``heldout.bin``: uint16 when the vocabulary fits, else uint32) with a
``meta.json``. Runs then memory-map them:

- the tokens are the ones the text path would produce, so packed tensors, streamed batches, the
  activation cache's key and every artifact are identical with or without preparation;
- a stream seeks to its position on resume (no document is read twice) and tokenises nothing on
  the training step's path;
- the number of training tokens is known up front, so ``data.num_tokens=all`` means one pass;
- the training split can be read in a seeded random order of its sequences (:meth:`PreparedTokens.shuffled`,
  ``data.shuffle_seed``): the cached sample is then a random sample of the whole split and the stream one
  pass over the rest in random order.

The directory is keyed by the source's fingerprint and the model's tokenizer source, under the
dofla cache (``<cache>/prepared/<key>``); ``meta.json`` also records a hash of the vocabulary,
checked against the run's tokenizer before any teacher pass.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from dofla.data.sources import DataError, DataSource, build_source
from dofla.data.stream import BatchStream
from dofla.data.token_stream import TokenStream
from dofla.data.tokens import pack_tokens

FORMAT = 1
PREPARED_MODES = ("auto", "require", "off")
META = "meta.json"
BATCH_DOCUMENTS = 256  # documents per tokenizer call while preparing


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and EOS id: two tokenizers with one fingerprint give the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([vocab, tokenizer.eos_token_id]).encode()).hexdigest()[:16]


def prepared_dir(root: Path, fingerprint: str, tokenizer_source: str, revision: str | None = None) -> Path:
    """Where the prepared tokens of data ``fingerprint`` under the tokenizer of ``tokenizer_source`` live."""
    key = hashlib.sha256(json.dumps([FORMAT, fingerprint, tokenizer_source, revision]).encode()).hexdigest()[:16]
    return Path(root) / "prepared" / key


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each non-empty document's ids followed by EOS (as ``pack_tokens``), one tokenizer call."""
    texts = [t for t in texts if t]
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [ids + [eos] if eos is not None else ids for ids in out]


def _write_split(texts: Iterable[str], tokenizer, path: Path, dtype, limit: int | None, desc: str) -> dict:
    """Tokenise ``texts`` into ``path`` until ``limit`` tokens (None: all); returns the counts."""
    written, documents, cut = 0, 0, False
    iterator: Iterator[str] = iter(texts)
    with open(path, "wb") as f, tqdm(total=limit, desc=desc, unit="tok") as bar:
        while limit is None or written < limit:
            chunk = []
            for text in iterator:
                if not isinstance(text, str):
                    raise DataError(f"the data source gave document {documents + len(chunk) + 1} as "
                                    f"{type(text).__name__}, not text; check its text field")
                chunk.append(text)
                if len(chunk) == BATCH_DOCUMENTS:
                    break
            if not chunk:
                break
            documents += len(chunk)
            ids = [t for doc in _ids(tokenizer, chunk) for t in doc]
            if limit is not None and written + len(ids) > limit:
                ids, cut = ids[: limit - written], True
            np.asarray(ids, dtype=dtype).tofile(f)
            written += len(ids)
            bar.update(len(ids))
    end = object()
    return {"tokens": written, "documents": documents, "complete": not cut and next(iterator, end) is end}


def prepare(source: DataSource, tokenizer, directory: str | Path, train_tokens: int | None = None,
            heldout_tokens: int | None = None, tokenizer_source: str = "") -> dict:
    """Tokenise ``source`` into ``directory`` (replaced atomically) and return its meta.

    ``train_tokens`` / ``heldout_tokens``: how many tokens of each split to keep (None: the whole
    split). A prepared split holding fewer than a run needs is reported by that run, not guessed.
    """
    directory = Path(directory)
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        splits = {split: _write_split(source.texts(split), tokenizer, tmp / f"{split}.bin", dtype, limit,
                                      desc=f"prepare {split}")
                  for split, limit in (("train", train_tokens), ("heldout", heldout_tokens))}
        meta = {"format": FORMAT, "fingerprint": source.fingerprint(), "source": source.name,
                "tokenizer": tokenizer_fingerprint(tokenizer), "tokenizer_source": tokenizer_source,
                "vocab_size": vocab, "eos": tokenizer.eos_token_id, "dtype": np.dtype(dtype).name, **splits}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


class PreparedTokens:
    """A prepared directory: packed tensors and streams of its tokens (memory-mapped, read lazily)."""

    def __init__(self, directory: str | Path, command: str = "dofla-prepare"):
        self.directory = Path(directory)
        self.command = command  # named in the too-few-tokens error
        try:
            self.meta = json.loads((self.directory / META).read_text())
        except (OSError, ValueError) as err:
            raise DataError(f"prepared data {self.directory} is unreadable ({type(err).__name__}); "
                            f"delete it and run {command} again") from None
        if self.meta.get("format") != FORMAT:
            raise DataError(f"prepared data {self.directory} has format {self.meta.get('format')}, this dofla "
                            f"reads {FORMAT}; run {command} again")
        self.name = self.meta["source"]
        self._arrays: dict[str, np.ndarray] = {}
        self.order: np.ndarray | None = None  # training sequences in reading order (None: as written)
        self.order_len = 0  # tokens per sequence of ``order``
        self.heldout_start = 0  # the held-out split is read from this token on (the test part: dofla.data.split)

    def shuffled(self, seq_len: int, seed: int) -> "PreparedTokens":
        """This data with its training split read as its whole sequences of ``seq_len`` tokens in the
        random order of ``seed`` (the same order for every run with this seed and length). Only a
        completely prepared split has one order, so a partial one is refused."""
        if not self.meta["train"]["complete"]:
            raise DataError(f"data.shuffle_seed reads the whole prepared training split, but {self.directory} holds "
                            f"only its first {self.written('train'):,} tokens; run {self.command} again (with "
                            "data.shuffle_seed set it prepares the whole split)")
        other = copy.copy(self)  # shares the memory-mapped files
        count = self.written("train") // seq_len
        other.order, other.order_len = np.random.default_rng(seed).permutation(count), seq_len
        return other

    def heldout_from(self, start: int) -> "PreparedTokens":
        """This data with its held-out split read from token ``start`` on: held-out token ``i`` of the
        result is token ``start + i`` of the file (the test part, :mod:`dofla.data.split`)."""
        other = copy.copy(self)  # shares the memory-mapped files
        other.heldout_start = start
        return other

    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def written(self, split: str) -> int:
        """Tokens in ``split``'s file."""
        return int(self.meta[split]["tokens"])

    def available(self, split: str) -> int:
        """Tokens ``split`` can serve (a shuffled training split: its whole sequences)."""
        if split == "train" and self.order is not None:
            return len(self.order) * self.order_len
        if split == "heldout":
            return max(0, self.written(split) - self.heldout_start)
        return self.written(split)

    def check(self) -> None:
        for split in ("train", "heldout"):
            path = self.directory / f"{split}.bin"
            size = np.dtype(self.meta["dtype"]).itemsize * self.written(split)
            if not path.is_file() or path.stat().st_size != size:
                raise DataError(f"prepared data {path} is missing or truncated; run {self.command} again")

    def check_tokenizer(self, tokenizer) -> None:
        if tokenizer_fingerprint(tokenizer) != self.meta["tokenizer"]:
            raise DataError(f"prepared data {self.directory} was tokenised by another tokenizer than this "
                            f"model's; run {self.command} for this model")

    def array(self, split: str) -> np.ndarray:
        if split not in self._arrays:
            count = self.written(split)
            self._arrays[split] = (np.memmap(self.directory / f"{split}.bin", dtype=self.meta["dtype"], mode="r",
                                             shape=(count,)) if count else np.zeros(0, dtype=self.meta["dtype"]))
        return self._arrays[split]

    def require(self, split: str, tokens: int, setting: str) -> None:
        """A DataError naming ``setting`` and the fix unless ``split`` serves ``tokens`` tokens."""
        have = self.available(split)
        if tokens > have:
            more = "" if self.meta[split]["complete"] else (
                f"; it was prepared with fewer tokens than the source holds, so run {self.command} with the "
                "settings of this run to prepare more")
            raise DataError(f"prepared {split} data ({self.name}) holds {have:,} tokens but this run needs "
                            f"{tokens:,} ({setting}){more}; or lower {setting}")

    def slice(self, split: str, start: int, count: int, setting: str) -> torch.LongTensor:
        """Tokens [start, start + count) of ``split``; a DataError naming ``setting`` when too few."""
        self.require(split, start + count, setting)
        if split == "train" and self.order is not None:
            return torch.from_numpy(self.array(split)[self._positions(start, count)].astype(np.int64))
        if split == "heldout":
            start += self.heldout_start
        return torch.from_numpy(self.array(split)[start:start + count].astype(np.int64))

    def _positions(self, start: int, count: int) -> np.ndarray:
        """File positions of tokens [start, start + count) of the shuffled order (a read may span sequences)."""
        L = self.order_len
        first, last = start // L, (start + count - 1) // L
        rows = self.order[first:last + 1, None] * L + np.arange(L)
        return rows.ravel()[start - first * L:start - first * L + count]

    def pack(self, split: str, seq_len: int, num_tokens: int, setting: str) -> torch.LongTensor:
        """The same (ceil(num_tokens / seq_len), seq_len) tensor ``pack_tokens`` makes of the text."""
        num_seqs = -(-num_tokens // seq_len)
        return self.slice(split, 0, num_seqs * seq_len, setting).view(num_seqs, seq_len)

    def stream(self, batch_size: int, seq_len: int, passes: int = 1, seed: int = 0) -> "TokenStream":
        return TokenStream(self, batch_size, seq_len, passes, seed)


def pack_split(source, split: str, tokenizer, seq_len: int, num_tokens: int, desc: str,
               setting: str = "data.num_tokens") -> torch.LongTensor:
    """(ceil(num_tokens / seq_len), seq_len) tokens of ``split``: sliced from prepared tokens, else
    tokenised from the source's text (:func:`~dofla.data.pack_tokens`); the same tensor either way."""
    if isinstance(source, PreparedTokens):
        return source.pack(split, seq_len, num_tokens, setting)
    return pack_tokens(source.texts(split), tokenizer, seq_len, num_tokens, desc=desc, source=source.name,
                       setting=setting)


def train_stream(source, tokenizer, batch_size: int, seq_len: int, passes: int = 1, seed: int = 0):
    """The training split as (batch_size, seq_len) batches: a ``TokenStream`` over prepared tokens, else a
    ``BatchStream`` tokenising the text (the same batches either way). ``passes`` > 1 (prepared tokens
    only): the text read again when it runs out (:class:`TokenStream`)."""
    if isinstance(source, PreparedTokens):
        return source.stream(batch_size, seq_len, passes, seed)
    if passes > 1:
        raise DataError(f"reading the training text {passes} times needs prepared tokens, and {source.name}'s are "
                        "not prepared; run dofla-prepare with this config first")
    return BatchStream(lambda: source.texts("train"), tokenizer, batch_size, seq_len, source=source.name)


def source_stream(name: str, options: dict, tokenizer, batch_size: int, seq_len: int) -> BatchStream:
    """The stream of a registered data source's "train" texts (``dofla.data.build_source``)."""
    return train_stream(build_source(name, **options), tokenizer, batch_size, seq_len)
