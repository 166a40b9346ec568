"""Data sources: the embedded corpus, a user's files with bad inputs, hub sources offline, packing."""
from __future__ import annotations

import json
import time

import pytest
import torch

from dofla.data import DataError, build_source, pack_tokens


def test_embedded_corpus_is_large_disjoint_and_stable():
    source = build_source("embedded")
    train, heldout = list(source.texts("train")), list(source.texts("heldout"))
    assert sum(map(len, train)) + sum(map(len, heldout)) >= 4_000_000
    assert not set(train) & set(heldout) and len(heldout) == 60 and len(train) == 1189 - 60
    assert heldout[0].startswith("Genesis 1\n") and heldout[1].startswith("Genesis 21\n")  # every 20th
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
    ("list.jsonl", b'{"text": "ok"}\n\n["text"]\n', "line 3 is not a JSON object"),
    ("num.jsonl", b'{"text": 7}\n', "line 1 has a non-string 'text' field"),
    ("late_nul.txt", b"a" * 70_000 + b"\x00", "binary"),
    ("rows.json", b'[{"text": "a"}]', "not JSONL"),
])
def test_bad_files_name_the_file_and_line(tmp_path, name, content, needle):
    path = _write(tmp_path, name, content)
    with pytest.raises(DataError) as err:
        list(build_source("text_files", paths=[path]).texts("train"))
    assert needle in str(err.value) and name in str(err.value)


def test_missing_file_and_skip_mode(tmp_path, caplog):
    with pytest.raises(DataError, match="nope.txt does not exist"):
        build_source("text_files", paths=[str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match="is a directory"):
        build_source("text_files", paths=[str(tmp_path)])
    with pytest.raises(DataError, match="heldout_fraction=1.5"):
        build_source("text_files", paths=[_write(tmp_path, "a.txt", b"a")], heldout_fraction=1.5)
    path = _write(tmp_path, "mixed.jsonl", b'{"text": "a"}\n{"x": 1}\n{"text": "b"}\n')
    source = build_source("text_files", paths=[path], on_bad_line="skip", heldout_fraction=0)
    assert list(source.texts("train")) == ["a", "b"] and source.skipped == 1
    assert "skipped 1 bad JSONL line" in caplog.text


def test_single_text_file_is_one_document_and_heldout_says_why(tmp_path):
    path = _write(tmp_path, "novel.txt", "Call me Ishmael.\n".encode())
    source = build_source("text_files", paths=path)  # a single path as a string is accepted
    assert list(source.texts("train")) == ["Call me Ishmael.\n"]
    with pytest.raises(DataError, match="fewer than 20 documents"):
        list(source.texts("heldout"))


def test_text_files_split_and_fingerprint(tmp_path):
    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40))
    path = _write(tmp_path, "docs.jsonl", lines.encode())
    source = build_source("text_files", paths=[path], heldout_fraction=0.1)
    train, heldout = list(source.texts("train")), list(source.texts("heldout"))
    assert len(heldout) == 4 and len(train) == 36
    before = source.fingerprint()
    assert build_source("text_files", paths=[path], heldout_fraction=0.1).fingerprint() == before
    copy = _write(tmp_path, "copy.jsonl", lines.encode())  # same content elsewhere: same cache key
    assert build_source("text_files", paths=[copy], heldout_fraction=0.1).fingerprint() == before
    _write(tmp_path, "docs.jsonl", (lines + '{"text": "new"}\n').encode())
    assert build_source("text_files", paths=[path], heldout_fraction=0.1).fingerprint() != before


@pytest.mark.parametrize("env", ["offline_set", "unset_closed_endpoint", "unset_real"])
@pytest.mark.parametrize("name", ["wikipedia", "wikitext103"])
def test_hub_sources_fail_fast_offline(name, env, monkeypatch):
    from huggingface_hub import constants

    from dofla.hub import hub_reachable

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    if env == "offline_set":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif env == "unset_closed_endpoint":  # the connectivity probe itself fails, on any machine
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    elif hub_reachable():
        pytest.skip("the hub is reachable here; this test checks the offline path")
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        next(build_source(name).texts("train"))
    assert time.perf_counter() - start < 20
    message = str(err.value)
    assert "could not download" in message and "data=embedded" in message
    assert ("wikimedia/wikipedia (20231101.en)" if name == "wikipedia" else "Salesforce/wikitext") in message
    assert ("offline mode is set" in message) == (env == "offline_set")


def test_pack_tokens(byte_tokenizer):
    rows = pack_tokens(iter(["abc", "de", "fgh"]), byte_tokenizer, seq_len=4, num_tokens=7)
    assert rows.dtype == torch.long and rows.tolist() == [[97, 98, 99, 256], [100, 101, 256, 102]]
    assert pack_tokens(["x" * 50], byte_tokenizer, seq_len=8, num_tokens=17).shape == (3, 8)


def test_pack_tokens_errors(byte_tokenizer):
    with pytest.raises(DataError, match=r"'embedded' \(tokenize\) yields only 4 tokens but data.num_tokens=100"):
        pack_tokens(iter(["abc"]), byte_tokenizer, seq_len=4, num_tokens=100, source="embedded")
    with pytest.raises(DataError, match="seq_len=0"):
        pack_tokens(["abc"], byte_tokenizer, seq_len=0, num_tokens=4)
    with pytest.raises(DataError, match="num_tokens=0"):
        pack_tokens(["abc"], byte_tokenizer, seq_len=4, num_tokens=0)
    with pytest.raises(DataError, match="document 2 as NoneType"):
        pack_tokens(["abc", None], byte_tokenizer, seq_len=4, num_tokens=8)


def test_load_data_names_the_source_and_the_setting(tmp_path, byte_tokenizer):
    from dofla.config import RunConfig
    from dofla.stages.data import load_data

    cfg = RunConfig()
    corpus = _write(tmp_path, "a.jsonl", b'{"text": "a few words"}\n' * 40)
    cfg.data.name, cfg.data.options = "text_files", {"paths": [corpus], "heldout_fraction": 0.5}
    cfg.data.seq_len, cfg.data.num_tokens, cfg.data.heldout_tokens = 16, 64, 10_000
    with pytest.raises(DataError, match=r"'text_files' \(tokenize held-out\) .* data.heldout_tokens=10000"):
        load_data(cfg, byte_tokenizer)


def test_hub_probe_bounds_a_hanging_dns_lookup(monkeypatch):
    """socket's timeout does not cover getaddrinfo; a resolver that hangs must still end in time."""
    import socket

    from huggingface_hub import constants

    from dofla.hub import hub_reachable

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with socket.socket() as server:  # a real listener: reachable
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_reachable(timeout=5)
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(30))  # a dead resolver
        start = time.perf_counter()
        assert not hub_reachable(timeout=0.5)
        assert time.perf_counter() - start < 5


def test_the_hub_check_goes_through_an_https_proxy_unless_no_proxy_bypasses_it(monkeypatch):
    import socket

    from huggingface_hub import constants

    from dofla.hub import hub_reachable

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "NO_PROXY", "no_proxy", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:9")  # closed: only a proxy can reach it
    assert not hub_reachable(timeout=2)
    with socket.socket() as proxy:  # a real listener standing in for the cluster's proxy
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        assert hub_reachable(timeout=2)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # bypassed: the closed endpoint is tried directly
        assert not hub_reachable(timeout=2)


def test_check_reads_only_the_start_and_respects_skip_mode(tmp_path):
    cut = _write(tmp_path, "cut.txt", b"a" * 65535 + "é".encode())  # the 64 KiB read ends mid-character
    assert list(build_source("text_files", paths=[cut], heldout_fraction=0).texts("train"))[0].endswith("é")
    late = _write(tmp_path, "late.txt", b"a" * 70_000 + "caf\xe9".encode("latin-1"))
    source = build_source("text_files", paths=[late], heldout_fraction=0)  # past the checked start
    with pytest.raises(DataError, match="late.txt is not UTF-8 text"):
        list(source.texts("train"))
    bad = _write(tmp_path, "bad.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not UTF-8"):
        build_source("text_files", paths=[bad])
    skipping = build_source("text_files", paths=[bad], on_bad_line="skip", heldout_fraction=0)
    assert list(skipping.texts("train")) == ["a", "b"] and skipping.skipped == 1


def test_data_is_checked_before_the_model_loads(tmp_path):
    from dofla.config import RunConfig
    from dofla.pipeline import run

    cfg = RunConfig()
    cfg.model.source = str(tmp_path / "no_model")  # loading it would fail with a model error
    cfg.data.name, cfg.data.options = "text_files", {"paths": [str(tmp_path / "nonexistent" / "a.txt")]}
    with pytest.raises(DataError, match="a.txt does not exist; fix data.options.paths"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "run.json").exists()


def _parquet(path, texts, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=7)
    return str(path)


def test_local_parquet_files_are_read_in_order_with_every_nth_row_held_out(tmp_path):
    docs = [f"document number {i}" for i in range(50)]
    a, b = _parquet(tmp_path / "a.parquet", docs[:30]), _parquet(tmp_path / "b.parquet", docs[30:])
    source = build_source("parquet", paths=[a, b], heldout_every=10)
    assert list(source.texts("heldout")) == docs[::10]
    assert list(source.texts("train")) == [d for i, d in enumerate(docs) if i % 10]
    copy = tmp_path / "copy"
    copy.mkdir()
    moved = [_parquet(copy / "x.parquet", docs[:30]), _parquet(copy / "y.parquet", docs[30:])]
    assert build_source("parquet", paths=moved, heldout_every=10).fingerprint() == source.fingerprint()
    with pytest.raises(DataError, match="has no 'body' column .*data.options.text_field"):
        build_source("parquet", paths=[a], text_field="body")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet is not a readable Parquet file"):
        build_source("parquet", paths=[str(tmp_path / "bad.parquet")])
    with pytest.raises(DataError, match="does not exist"):
        build_source("parquet", paths=[str(tmp_path / "missing.parquet")])


def test_wikipedia_from_local_parquet_keeps_the_hubs_articles(tmp_path):
    """The same seeded 10 % (and held-out rows) as the hub path, which the hash of each row's index picks."""
    from dofla.data.hub import Wikipedia

    docs = [f"article {i}" for i in range(3000)]
    files = [_parquet(tmp_path / "train-00000.parquet", docs[:1700]), _parquet(tmp_path / "train-00001.parquet",
                                                                               docs[1700:])]
    local = build_source("wikipedia", fraction=0.1, heldout_every=100, files=files)
    hub_rule = Wikipedia(fraction=0.1, heldout_every=100)  # the hub's selection rule, applied to the same rows
    kept = [(i, d) for i, d in enumerate(docs) if hub_rule._keep(i)]
    assert list(local.texts("train")) == [d for i, d in kept if i % 100]
    assert list(local.texts("heldout")) == [d for i, d in kept if i % 100 == 0]
    assert 200 < len(kept) < 400 and local.fingerprint() != hub_rule.fingerprint()
