"""data.shuffle_seed: the prepared training split in a seeded random order of its sequences, so the
cached sample (Algorithm 1's) is a random sample of the whole split and the stream one pass over the rest."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.data import DataError, build_source
from dofla.data.prepared import PreparedTokens, prepare
from dofla.models.tiny import build_byte_tokenizer
from dofla.stages import data
from dofla.stages.keys import cache_fields, layer_meta
from dofla.validate import ConfigError, validate_config

WORDS = "a stream of fresh tokens in a random order over the whole prepared split".split()
L = 16


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def corpus_path(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))}) for _ in range(150)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def prepared(corpus_path, tokenizer, tmp_path):
    prepare(build_source("text_files", paths=[str(corpus_path)]), tokenizer, tmp_path / "p")
    return PreparedTokens(tmp_path / "p")


def reference_order(prepared: PreparedTokens, seed: int) -> torch.Tensor:
    """The plain reference: every whole sequence of the file, permuted, concatenated."""
    rows = prepared.slice("train", 0, prepared.available("train") // L * L, "x").view(-1, L)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(rows.shape[0]))
    return rows[order].flatten()


def test_a_shuffled_split_is_its_whole_sequences_in_the_seeds_order_read_at_any_offset(prepared):
    one, again, other = prepared.shuffled(L, 1), prepared.shuffled(L, 1), prepared.shuffled(L, 2)
    n = one.available("train")
    assert n == prepared.available("train") // L * L and n > 40 * L
    everything = one.slice("train", 0, n, "x")
    assert torch.equal(everything, reference_order(prepared, 1))
    assert torch.equal(everything, again.slice("train", 0, n, "x"))  # one seed, one order
    assert not torch.equal(everything, other.slice("train", 0, n, "x"))
    sequential = prepared.slice("train", 0, n, "x").view(-1, L)
    assert not torch.equal(everything.view(-1, L), sequential)
    assert sorted(map(tuple, everything.view(-1, L).tolist())) == sorted(map(tuple, sequential.tolist()))
    for start, count in ((5, 3 * L + 7), (L - 1, 2), (n - 9, 9), (2 * L, L)):  # reads across sequences
        assert torch.equal(one.slice("train", start, count, "x"), everything[start:start + count])
    with pytest.raises(DataError, match="holds"):
        one.slice("train", n - 4, 5, "data.num_tokens")
    assert prepared.order is None  # the original still reads the file in order


def test_the_sample_and_the_stream_split_the_shuffled_sequences_between_them(prepared, tokenizer):
    shuffled = prepared.shuffled(L, 0)
    sample_seqs = 4
    sample = shuffled.pack("train", L, sample_seqs * L, "data.cache_tokens")
    stream = shuffled.stream(2, L)
    stream.discard(sample_seqs * L)
    streamed = torch.cat(list(stream))
    read = torch.cat([sample, streamed]).flatten()
    assert torch.equal(read, reference_order(prepared, 0)[: read.numel()])
    # the sample is spread over the split, not its first articles
    rows = prepared.slice("train", 0, shuffled.available("train"), "x").view(-1, L).tolist()
    where = sorted(rows.index(row) for row in sample.tolist())
    assert where[-1] >= sample_seqs  # not the first sequences
    # resume: the state of the shuffled stream restores its position
    resumed = shuffled.stream(2, L)
    resumed.discard(sample_seqs * L)
    first = resumed.next_batch()
    state, expected = resumed.state(), resumed.next_batch()
    fresh = shuffled.stream(2, L)
    fresh.restore(state)
    assert torch.equal(fresh.next_batch(), expected) and torch.equal(first, streamed[:2])


def tiny(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["experiment=smoke_tiny", *overrides]))


def test_a_shuffled_run_needs_the_whole_split_prepared_and_says_so_before_loading(tmp_path, corpus_path, tokenizer):
    base = ["data=text_files", f"data.options.paths=[{corpus_path}]", f"data.seq_len={L}", "data.num_tokens=256",
            "data.heldout_tokens=64", f"paths.cache_dir={tmp_path / 'cache'}", "data.shuffle_seed=7"]
    with pytest.raises(DataError, match="data.shuffle_seed reads the prepared tokens.*dofla-prepare"):
        data.open_data(tiny(*base))
    with pytest.raises(ConfigError, match="data.shuffle_seed .*data.prepared=off"):
        validate_config(tiny(*base, "data.prepared=off"))
    unshuffled = tiny(*base[:-1])
    assert data.prepare_limits(unshuffled)[0] is not None and data.prepare_limits(tiny(*base))[0] is None
    data.prepare(unshuffled)  # a prefix of the split only
    with pytest.raises(DataError, match="holds only its first .* tokens; run dofla-prepare"):
        data.open_data(tiny(*base))
    directory, meta = data.prepare(tiny(*base))  # the whole split
    assert meta["train"]["complete"]
    cfg, source = data.open_data(tiny(*base))
    assert source.order is not None and source.order_len == L
    packed = data.load_data(cfg, tokenizer, source, 64)[0]
    assert torch.equal(packed.flatten(), source.slice("train", 0, 64, "x"))


def test_the_shuffle_seed_names_its_artifacts_and_leaves_the_sequential_keys_alone(tmp_path):
    sequential, shuffled = tiny("train.source=stream"), tiny("train.source=stream", "data.shuffle_seed=0")
    assert "shuffle_seed" not in cache_fields(sequential, "fp")
    assert cache_fields(shuffled, "fp")["shuffle_seed"] == 0
    assert "shuffle_seed" not in json.dumps(layer_meta(sequential, "k"))
    assert layer_meta(shuffled, "k")["stream"]["data"]["shuffle_seed"] == 0
