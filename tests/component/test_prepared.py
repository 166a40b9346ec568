"""Prepared data (dofla-prepare): the text path's tokens, read from disk; O(1) resume; num_tokens=all."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.data import DataError, build_source, pack_tokens
from dofla.data.prepared import PreparedTokens, pack_split, prepare, train_stream
from dofla.data.token_stream import TokenStream
from dofla.data.sources import DATA_SOURCES, DataSource
from dofla.data.stream import BatchStream, StreamExhausted
from dofla.models.tiny import build_byte_tokenizer
from dofla.stages import data
from dofla.validate import ConfigError, validate_config
from tests.conftest import reproducible

WORDS = "in the beginning god created heaven and earth light darkness water firmament".split()


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))}) for _ in range(200)]
    path.write_text("\n".join(lines) + "\n")
    return build_source("text_files", paths=[str(path)], heldout_fraction=0.1)


def test_prepared_tokens_are_the_text_paths_tokens(corpus, tokenizer, tmp_path):
    meta = prepare(corpus, tokenizer, tmp_path / "p")
    prepared = PreparedTokens(tmp_path / "p")
    prepared.check()
    assert meta["dtype"] == "uint16" and meta["train"]["complete"] and meta["heldout"]["complete"]
    assert prepared.fingerprint() == corpus.fingerprint()
    for split, n in (("train", 3000), ("heldout", 500)):
        reference = pack_tokens(corpus.texts(split), tokenizer, 32, n)
        assert torch.equal(pack_split(prepared, split, tokenizer, 32, n, desc=""), reference)
        assert torch.equal(pack_split(corpus, split, tokenizer, 32, n, desc=""), reference)
    # the whole split, token for token: every document's ids and its EOS
    everything = pack_tokens(corpus.texts("train"), tokenizer, 1, meta["train"]["tokens"])
    assert torch.equal(prepared.slice("train", 0, meta["train"]["tokens"], "x"), everything.flatten())


def test_token_stream_serves_the_batch_streams_batches_and_resumes_either_way(corpus, tokenizer, tmp_path):
    prepare(corpus, tokenizer, tmp_path / "p")
    prepared = PreparedTokens(tmp_path / "p")
    text, fast = train_stream(corpus, tokenizer, 2, 24), train_stream(prepared, tokenizer, 2, 24)
    assert isinstance(text, BatchStream) and isinstance(fast, TokenStream)
    text.discard(100)
    fast.discard(100)
    for _ in range(5):
        assert torch.equal(text.next_batch(), fast.next_batch())
    # a prepared stream resumes a text stream's state, and the other way round
    resumed_fast, resumed_text = prepared.stream(2, 24), BatchStream(lambda: corpus.texts("train"), tokenizer, 2, 24)
    resumed_fast.restore(text.state())
    resumed_text.restore(fast.state())
    expected = text.next_batch()
    assert torch.equal(resumed_fast.next_batch(), expected)
    assert torch.equal(resumed_text.next_batch(), expected)
    assert torch.equal(fast.next_batch(), expected)
    # running out: StreamExhausted (a DataError) with the tokens served
    left = (prepared.available("train") - fast.offset) // fast.batch_tokens
    assert len(list(fast)) == left
    with pytest.raises(StreamExhausted):
        fast.next_batch()


class CountingSource(DataSource):
    """Counts every document it hands out (the test's view of "reads the source")."""

    name = "counting_test"
    reads = 0

    def __init__(self, docs: int = 120):
        rng = random.Random(1)
        self.docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 50))) for _ in range(docs)]

    def texts(self, split):
        for i, doc in enumerate(self.docs):
            if (i % 10 == 0) == (split == "heldout"):
                CountingSource.reads += 1
                yield doc

    def fingerprint(self):
        return f"counting-{len(self.docs)}"


@pytest.fixture(autouse=True)
def counting_source(monkeypatch):
    """CountingSource registered for this module's tests only (the registry is global)."""
    monkeypatch.setitem(DATA_SOURCES._items, "counting_test", CountingSource)


def tiny(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["experiment=smoke_tiny", *overrides]))


def test_a_resumed_prepared_stream_reads_no_document_from_the_source(tmp_path, tokenizer):
    cfg = tiny(f"paths.cache_dir={tmp_path}", "data.name=counting_test", "data.num_tokens=512", "data.seq_len=32")
    directory, meta = data.prepare(cfg)
    reads_to_prepare = CountingSource.reads
    assert 0 < reads_to_prepare <= 120  # one pass at most (train and held-out once each)
    cfg, source = data.open_data(cfg)
    assert isinstance(source, PreparedTokens) and source.directory == directory
    stream = data.training_stream(cfg, tokenizer, 2, skip_tokens=64)
    first = [stream.next_batch() for _ in range(3)]
    state = stream.state()
    again = data.training_stream(cfg, tokenizer, 2, skip_tokens=0)
    again.restore(state)
    nxt = again.next_batch()
    assert CountingSource.reads == reads_to_prepare  # neither the run nor its resume touched the source
    off = tiny(f"paths.cache_dir={tmp_path}", "data.name=counting_test", "data.num_tokens=512", "data.seq_len=32",
               "data.prepared=off")
    text = data.training_stream(off, tokenizer, 2, skip_tokens=64)
    assert all(torch.equal(text.next_batch(), b) for b in [*first, nxt])  # the text path's batches
    text.close()  # its worker (data.prefetch) would go on reading ahead
    before = CountingSource.reads
    data.prepare(cfg)  # prepared again with the same needs: kept, the source is not read
    assert CountingSource.reads == before


def test_num_tokens_all_is_one_pass_over_the_prepared_split_less_the_sample_and_distill(tmp_path):
    base = [f"paths.cache_dir={tmp_path}", "data.name=counting_test", "data.seq_len=32", "train.source=stream",
            "data.cache_tokens=256"]
    with pytest.raises(DataError, match="dofla-prepare"):
        data.open_data(tiny(*base, "data.num_tokens=all"))  # nothing prepared yet: one sentence, no model
    with pytest.raises(DataError, match="data.prepared=require"):
        data.open_data(tiny(*base, "data.prepared=require"))
    data.prepare(tiny(*base, "data.num_tokens=all"))
    cfg, source = data.open_data(tiny(*base, "data.num_tokens=all"))
    total = source.available("train")
    assert cfg.data.num_tokens == (total - 256) // 32 * 32
    cfg, _ = data.open_data(tiny(*base, "data.num_tokens=all", "distill=kl", "distill.tokens=512",
                                 "distill.seq_len=32", "distill.batch_size=2"))
    assert cfg.data.num_tokens == (total - 256 - 512) // 32 * 32
    cfg, _ = data.open_data(tiny(*base, "data.num_tokens=600"))
    assert cfg.data.num_tokens == 600  # a number stays a number


def test_a_run_whose_eval_needs_more_held_out_tokens_than_prepared_is_refused_before_any_model(tmp_path):
    base = [f"paths.cache_dir={tmp_path}", "data.name=counting_test", "data.seq_len=32", "data.num_tokens=256",
            "data.heldout_tokens=64", "eval.position_buckets=[1,16,32]", "eval.long_seq_len=64"]
    data.prepare(tiny(*base, "eval.long_context_seqs=1"))  # 64 held-out tokens
    data.open_data(tiny(*base, "eval.long_context_seqs=1"))
    assert data.heldout_need(tiny(*base, "eval.long_context_seqs=3")) == (192, "eval.long_context_seqs")
    with pytest.raises(DataError, match="holds 64 tokens but this run needs 192 .eval.long_context_seqs.*dofla-prepare"):
        data.open_data(tiny(*base, "eval.long_context_seqs=3"))  # was: an error after training, at the eval
    with pytest.raises(DataError, match="needs 96 .data.heldout_tokens."):
        data.open_data(tiny(*base, "eval.long_context_seqs=1", "data.heldout_tokens=96"))
    data.prepare(tiny(*base, "eval.long_context_seqs=3"))  # prepared again with the run's settings: it runs
    assert data.open_data(tiny(*base, "eval.long_context_seqs=3"))[1].available("heldout") >= 192


def test_too_few_prepared_tokens_and_another_tokenizer_are_one_sentence(tmp_path, corpus, tokenizer):
    prepare(corpus, tokenizer, tmp_path / "p", train_tokens=500, heldout_tokens=100)
    prepared = PreparedTokens(tmp_path / "p", command="dofla-prepare X")
    assert not prepared.meta["train"]["complete"] and prepared.available("train") == 500
    with pytest.raises(DataError, match="holds 500 tokens but this run needs 640.*dofla-prepare X"):
        prepared.pack("train", 64, 600, "data.num_tokens")
    other = build_byte_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(DataError, match="another tokenizer"):
        prepared.check_tokenizer(other)
    (tmp_path / "p" / "train.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="truncated"):
        prepared.check()
    assert np.fromfile(tmp_path / "p" / "heldout.bin", dtype=np.uint16).size == 100


@pytest.mark.parametrize("value, message", [("abc", "must be a number of tokens or 'all'"),
                                            ("0", "must be > 0|must be ≥ 1|positive")])
def test_bad_num_tokens_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny(f"data.num_tokens={value}"))
    with pytest.raises(ConfigError, match="data.prepared"):
        validate_config(tiny("data.prepared=maybe"))
    with pytest.raises(ConfigError, match="data.prepared=off"):
        validate_config(tiny("data.num_tokens=all", "data.prepared=off"))


def test_a_run_on_prepared_tokens_equals_the_run_on_text_and_records_the_resolved_count(tmp_path):
    from dofla import pipeline

    base = [f"paths.cache_dir={tmp_path / 'cache'}", "data.name=counting_test", "data.seq_len=32", "train.source=stream",
            "data.cache_tokens=128", "data.heldout_tokens=128", "train.batch_size=2", "eval.attention_error=false",
            "stages=[cache,allocate,train,assemble,eval]"]
    text = pipeline.run(tiny(*base, "data.num_tokens=512", "data.prepared=off"), tmp_path / "text")
    data.prepare(tiny(*base, "data.num_tokens=all"))
    before = CountingSource.reads
    fast = pipeline.run(tiny(*base, "data.num_tokens=512"), tmp_path / "prepared")
    assert CountingSource.reads == before
    assert reproducible(text) == reproducible(fast)
    everything = pipeline.run(tiny(*base, "data.num_tokens=all"), tmp_path / "all")
    recorded = json.loads((tmp_path / "all" / "run.json").read_text())["config"]["data"]["num_tokens"]
    assert isinstance(recorded, int) and recorded > 512 and everything["train/tokens"] >= recorded // 64 * 64


def test_the_dofla_prepare_command_prepares_what_the_run_reads_and_says_so(tmp_path, corpus, capsys):
    from dofla.cli import prepare_main

    paths = ",".join(str(p) for p in corpus.paths)
    overrides = ["experiment=smoke_tiny", "data=text_files", f"data.options.paths=[{paths}]", "data.seq_len=32",
                 "data.num_tokens=256", "data.heldout_tokens=64", f"paths.cache_dir={tmp_path / 'cache'}"]
    prepare_main(overrides)
    out = capsys.readouterr().out
    assert "train: " in out and "a prefix of the split" in out and "runs of this config read it" in out
    cfg, source = data.open_data(tiny(*overrides[1:]))
    assert isinstance(source, PreparedTokens) and source.available("train") == 256 + 256  # sample + stream
    prepare_main([*overrides, "data.num_tokens=all"])  # the whole split now
    assert "the whole split" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="dofla-prepare: error: data.num_tokens='x'"):
        prepare_main([*overrides, "data.num_tokens=x"])


def test_a_stream_of_two_passes_serves_its_own_batches_again_in_another_order_and_resumes(corpus, tokenizer, tmp_path):
    from dofla.data.prefetch import prefetched

    prepare(corpus, tokenizer, tmp_path / "p")
    prepared = PreparedTokens(tmp_path / "p")
    once, twice = prepared.stream(2, 24), prepared.stream(2, 24, passes=2, seed=3)
    once.discard(100)  # e.g. a cached sample: held out of every pass
    twice.discard(100)
    first = list(once)
    assert len(first) > 3 and all(torch.equal(a, twice.next_batch()) for a in first)  # pass 1: the one pass
    states, second = [], []
    for _ in first:
        states.append(twice.state())
        second.append(twice.next_batch())
    key = lambda b: b.numpy().tobytes()  # noqa: E731
    assert sorted(map(key, second)) == sorted(map(key, first)) and list(map(key, second)) != list(map(key, first))
    with pytest.raises(StreamExhausted, match="2 of 2 passes"):
        twice.next_batch()
    # resumed anywhere in the second pass (and through a prefetcher): the same batches on
    middle = len(first) // 2
    resumed = prefetched(prepared.stream(2, 24, passes=2, seed=3), 2)
    resumed.restore(states[middle])
    assert all(torch.equal(resumed.next_batch(), b) for b in second[middle:])
    resumed.close()
    # another seed, another order; skip_to lands where serving did (no discard: the passes start at 0)
    other = prepared.stream(2, 24, passes=2, seed=4)
    skipped, served = prepared.stream(2, 24, passes=2, seed=3), prepared.stream(2, 24, passes=2, seed=3)
    count = prepared.available("train") // 48
    for _ in range(count + 2):
        served.next_batch()
        other.next_batch()
    skipped.skip_to(count + 2)
    assert torch.equal(skipped.next_batch(), served.next_batch())
    assert skipped.state() == served.state() and not torch.equal(other.next_batch(), served.next_batch())


def test_passes_are_refused_where_the_text_cannot_be_read_again(corpus, tokenizer):
    with pytest.raises(DataError, match="needs prepared tokens"):
        train_stream(corpus, tokenizer, 2, 24, passes=2)
    with pytest.raises(ConfigError, match=r"distill.passes=0 must be a whole number ≥ 1"):
        validate_config(tiny("distill=kl", "distill.passes=0"))
    with pytest.raises(ConfigError, match="data.prepared=off turns off"):
        validate_config(tiny("distill=kl", "distill.passes=2", "data.prepared=off"))


def test_a_kl_stage_longer_than_the_split_reads_its_text_twice(tmp_path):
    from dofla import pipeline

    base = [f"paths.cache_dir={tmp_path / 'cache'}", "data.name=counting_test", "data.seq_len=32", "train.source=stream",
            "data.cache_tokens=128", "data.heldout_tokens=128", "data.num_tokens=256", "train.batch_size=2",
            "eval.attention_error=false", "distill=kl", "distill.seq_len=32", "distill.batch_size=2",
            "stages=[cache,allocate,train,assemble,distill]"]
    data.prepare(tiny(*base))
    _, source = data.open_data(tiny(*base))
    room = (source.available("train") - 128 - 256) // 64 * 64  # the KL text after the sample and the layerwise stage's
    pipeline.run(tiny(*base, f"distill.tokens={room + 256}"), tmp_path / "once")
    pipeline.run(tiny(*base, f"distill.tokens={room + 256}", "distill.passes=2"), tmp_path / "twice")
    used = {run: json.loads((tmp_path / run / "distill_summary.json").read_text())["tokens"] for run in ("once", "twice")}
    assert used == {"once": room, "twice": room + 256}  # one pass stops where the text ends; two read on
