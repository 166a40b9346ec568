"""The held-out text's dev and test parts (data.heldout_split): disjoint, test the unscored remainder,
refused in one sentence when too small, and keyed apart where the scores are kept."""
from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import torch
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.data import DataError, pack_tokens
from dofla.data.sources import DATA_SOURCES, DataSource
from dofla.models.tiny import build_byte_tokenizer
from dofla.pipeline import heldout_tokens, long_heldout_tokens
from dofla.report.seeds import settings_key
from dofla.stages import data
from dofla.stages.eval import tokens_digest
from dofla.stages.keys import cache_fields, layer_meta

WORDS = "and the lord said unto moses in the wilderness of sinai after they were come out".split()
L = 32  # data.seq_len of these runs


class SplitSource(DataSource):
    """A tiny corpus whose every 5th document is held out (about 1,800 held-out tokens)."""

    name = "split_test"
    prepares_itself = True

    def __init__(self, docs: int = 120):
        rng = random.Random(2)
        self.docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(docs)]

    def texts(self, split):
        for i, doc in enumerate(self.docs):
            if (i % 5 == 0) == (split == "heldout"):
                yield doc

    def fingerprint(self):
        return f"split-{len(self.docs)}"


@pytest.fixture(autouse=True)
def split_source(monkeypatch):
    monkeypatch.setitem(DATA_SOURCES._items, "split_test", SplitSource)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def tiny(tmp_path, *overrides):
    base = [f"paths.cache_dir={tmp_path}", "data.name=split_test", f"data.seq_len={L}", "data.num_tokens=256",
            "data.test_start=512", "data.heldout_tokens=512"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["experiment=smoke_tiny", *base, *overrides]))


def whole_heldout(tokenizer) -> torch.Tensor:
    """The plain reference: every held-out token of the text, tokenised in one pass."""
    texts = list(SplitSource().texts("heldout"))
    total = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
    return pack_tokens(iter(texts), tokenizer, 1, total).flatten()


def test_dev_and_test_never_overlap_and_test_is_exactly_the_unscored_remainder(tmp_path, tokenizer):
    whole = whole_heldout(tokenizer)
    rest = (len(whole) - 512) // L * L  # the test part in whole sequences
    assert rest >= 20 * L
    dev_cfg = tiny(tmp_path)
    test_cfg = tiny(tmp_path, "data.heldout_split=test")  # data.test_tokens=None: all of the test part
    data.open_or_prepare(test_cfg)  # prepares itself, the whole held-out text (the test part needs it)
    dev, test = heldout_tokens(dev_cfg, tokenizer), heldout_tokens(test_cfg, tokenizer)
    assert torch.equal(dev.flatten(), whole[:512])  # dev: what a run scored before the split existed
    assert torch.equal(test.flatten(), whole[512:512 + rest])  # test: every token after dev, none before
    assert len(whole) - 512 - rest < L  # nothing is left but a part sequence
    # the default run reads dev from the text as it always has (no prepared tokens), the same tokens
    text_cfg = tiny(tmp_path, "data.prepared=off")
    assert not isinstance(data.open_data(text_cfg)[1], type(data.open_data(test_cfg)[1]))
    assert torch.equal(heldout_tokens(text_cfg, tokenizer), dev)
    # the long sequences of the loss by position come from the same part
    long = ["eval.position_buckets=[1,32,64]", "eval.long_seq_len=64", "eval.long_context_seqs=4"]
    long_test = long_heldout_tokens(tiny(tmp_path, "data.heldout_split=test", *long), tokenizer)
    assert torch.equal(long_test.flatten(), whole[512:512 + 256])
    assert torch.equal(long_heldout_tokens(tiny(tmp_path, *long), tokenizer).flatten(), whole[:256])


def test_a_request_past_its_part_is_one_sentence_before_any_model(tmp_path, tokenizer):
    whole = whole_heldout(tokenizer)
    data.open_or_prepare(tiny(tmp_path, "data.heldout_split=test", "data.test_tokens=64"))
    have = len(whole) - 512
    too_many = (have // L + 1) * L
    with pytest.raises(DataError, match=f"holds {have:,} of them, fewer than the {too_many:,} "
                                        "data.test_tokens asks for; lower data.test_tokens$"):
        data.open_or_prepare(tiny(tmp_path, "data.heldout_split=test", f"data.test_tokens={too_many}"))
    whole_seqs = tiny(tmp_path, "data.heldout_split=test", f"data.test_tokens={have // L * L}")
    assert torch.equal(heldout_tokens(whole_seqs, tokenizer), heldout_tokens(tiny(tmp_path, "data.heldout_split=test"),
                                                                             tokenizer))
    with pytest.raises(DataError, match=f"fewer than the {(have // L + 1) * L:,} data.test_tokens"):
        data.open_data(tiny(tmp_path, "data.heldout_split=test", f"data.test_tokens={have // L * L + 1}"))
    with pytest.raises(DataError, match="eval.long_context_seqs asks for"):
        data.open_data(tiny(tmp_path, "data.heldout_split=test",
                            "eval.position_buckets=[1,32]", "eval.long_seq_len=64", "eval.long_context_seqs=40"))
    with pytest.raises(DataError, match="past the dev part .the first data.test_start=512. into the test part"):
        data.open_data(tiny(tmp_path, "data.heldout_tokens=544"))
    with pytest.raises(DataError, match="data.prepared=off turns off; set data.prepared=auto"):
        data.open_data(tiny(tmp_path, "data.heldout_split=test", "data.prepared=off"))
    with pytest.raises(DataError, match="must be one of dev, test"):
        data.open_data(tiny(tmp_path, "data.heldout_split=train"))
    with pytest.raises(DataError, match="data.test_tokens=0 must be a positive number"):
        data.open_data(tiny(tmp_path, "data.heldout_split=test", "data.test_tokens=0"))


def test_a_dev_prepared_corpus_is_prepared_again_for_test(tmp_path, tokenizer):
    """Prepared for a dev run (the held-out text cut after its tokens), then asked for test: the
    corpus prepares the tokens the test part needs instead of refusing or reading past the file."""
    directory, meta = data.prepare(tiny(tmp_path, "data.prepared=require"))
    assert meta["heldout"]["tokens"] == 512 and not meta["heldout"]["complete"]
    cfg = tiny(tmp_path, "data.heldout_split=test", "data.test_tokens=128")
    _, source = data.open_or_prepare(cfg)
    assert source.directory == directory and source.written("heldout") == 512 + 128
    assert torch.equal(heldout_tokens(cfg, tokenizer).flatten(), whole_heldout(tokenizer)[512:640])


def test_test_runs_share_the_trained_artifacts_and_score_under_their_own_keys(tmp_path, tokenizer):
    dev_cfg = tiny(tmp_path, "train.source=stream")
    test_cfg = tiny(tmp_path, "train.source=stream", "data.heldout_split=test")
    data.open_or_prepare(test_cfg)
    # the activation cache and the (streamed) layers are the dev run's: the split trains nothing
    assert cache_fields(dev_cfg, "f") == cache_fields(test_cfg, "f")
    assert layer_meta(dev_cfg, "c") == layer_meta(test_cfg, "c")
    # every evaluation measurement's key holds the digest of the tokens it scored
    assert tokens_digest(heldout_tokens(dev_cfg, tokenizer)) != tokens_digest(heldout_tokens(test_cfg, tokenizer))
    # runs on test never group with runs on dev; a record from before the split groups with dev
    dev, test = asdict(dev_cfg), asdict(test_cfg)
    assert settings_key(dev) != settings_key(test)
    dev = {**dev, "data": {**dev["data"], "test_start": 65536}}  # the default boundary
    old = {**dev, "data": {k: v for k, v in dev["data"].items() if k not in ("heldout_split", "test_start")}}
    assert settings_key(old) == settings_key(dev)
