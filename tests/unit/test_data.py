"""Data sources: the embedded corpus, a user's files with bad inputs, hub sources offline, packing."""
from __future__ import annotations

import json
import time

import pytest

from dofla.data import DataError, build_source, pack_tokens


def test_embedded_corpus_is_large_disjoint_and_stable():
    source = build_source("embedded")
    train, heldout = list(source.texts("train")), list(source.texts("heldout"))
    assert sum(map(len, train)) + sum(map(len, heldout)) >= 4_000_000
    assert not set(train) & set(heldout) and len(heldout) == 60
    assert heldout[:3] == list(build_source("embedded").texts("heldout"))[:3]
    assert source.fingerprint() == build_source("embedded").fingerprint()


def _write(tmp_path, name, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("name,content,needle", [
    ("empty.txt", b"", "is empty"),
    ("blob.txt", b"abc\x00\x01\x02", "binary"),
    ("latin.txt", "caf\xe9\nna\xefve".encode("latin-1"), "not UTF-8"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": broken\n', "line 2 is not valid JSON"),
    ("field.jsonl", b'{"text": "ok"}\n{"body": "no text"}\n', "line 2 has no 'text' field"),
    ("enc.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2 is not UTF-8"),
])
def test_bad_files_name_the_file_and_line(tmp_path, name, content, needle):
    path = _write(tmp_path, name, content)
    with pytest.raises(DataError) as err:
        list(build_source("text_files", paths=[path]).texts("train"))
    assert needle in str(err.value) and name in str(err.value)


def test_missing_file_and_skip_mode(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_source("text_files", paths=[str(tmp_path / "nope.txt")])
    path = _write(tmp_path, "mixed.jsonl", b'{"text": "a"}\n{"x": 1}\n{"text": "b"}\n')
    source = build_source("text_files", paths=[path], on_bad_line="skip", heldout_fraction=0)
    assert list(source.texts("train")) == ["a", "b"] and source.skipped == 1


def test_text_files_split_and_fingerprint(tmp_path):
    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40))
    path = _write(tmp_path, "docs.jsonl", lines.encode())
    source = build_source("text_files", paths=[path], heldout_fraction=0.1)
    train, heldout = list(source.texts("train")), list(source.texts("heldout"))
    assert len(heldout) == 4 and len(train) == 36
    before = source.fingerprint()
    _write(tmp_path, "docs.jsonl", (lines + '{"text": "new"}\n').encode())
    assert build_source("text_files", paths=[path]).fingerprint() != before


@pytest.mark.parametrize("name", ["wikipedia", "wikitext103"])
def test_hub_sources_fail_fast_offline(name):
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        next(build_source(name).texts("train"))
    assert time.perf_counter() - start < 30
    assert "could not download" in str(err.value) and "data=embedded" in str(err.value)


def test_pack_tokens(byte_tokenizer):
    rows = pack_tokens(iter(["abc", "de", "fgh"]), byte_tokenizer, seq_len=4, num_tokens=7)
    assert rows.tolist() == [[97, 98, 99, 256], [100, 101, 256, 102]]
    with pytest.raises(DataError, match="yields only"):
        pack_tokens(iter(["abc"]), byte_tokenizer, seq_len=4, num_tokens=100)
