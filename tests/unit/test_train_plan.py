"""The TrainPlan: the training mode, the source and the token ledger, worked out in one place."""
from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from dofla.config import DataConfig, DistillConfig, LossConfig, RunConfig, TrainConfig
from dofla.errors import ConfigError
from dofla.stages.plan import reserved_tokens, train_plan


def config(num_tokens=1000, seq_len=64, cache_tokens=None, loss="softmax", source="auto", distill=None) -> RunConfig:
    return RunConfig(data=DataConfig(num_tokens=num_tokens, seq_len=seq_len, cache_tokens=cache_tokens,
                                     heldout_tokens=256),
                     loss=LossConfig(name=loss), train=TrainConfig(source=source),
                     distill=distill or DistillConfig())


def test_the_cache_path_caches_every_token_and_distill_reads_after_them():
    plan = train_plan(config(), "cache")
    assert (plan.mode, plan.source, plan.reads_cache, plan.streams, plan.direct) == \
        ("layerwise", "cache", True, False, False)
    ledger = plan.ledger
    assert (ledger.cached, ledger.streamed, ledger.skipped, ledger.kl_offset, ledger.kl_tokens, ledger.heldout) == \
        (1000, 0, 0, 1000, 0, 256)


def test_a_stream_caches_a_sample_skips_it_in_whole_sequences_and_distill_reads_after_both():
    plan = train_plan(config(num_tokens=20_000, cache_tokens=300, distill=DistillConfig(name="kl", tokens=512)),
                      "stream")
    ledger = plan.ledger
    assert plan.streams and not plan.reads_cache
    assert ledger.cached == 300 and ledger.skipped == 320  # the packed sample: ceil(300 / 64) sequences
    assert ledger.streamed == 20_000 and ledger.kl_offset == 300 + 20_000 and ledger.kl_tokens == 512
    default = train_plan(config(num_tokens=20_000), "stream").ledger
    assert default.cached == 8192 and default.skipped == 8192
    small = train_plan(config(num_tokens=1000), "stream").ledger  # the sample never exceeds num_tokens
    assert small.cached == 1000 and small.skipped == 1024


def test_without_a_train_stage_distill_still_skips_what_the_configured_source_would_read():
    assert train_plan(config(source="stream"), "none").ledger.kl_offset == 1000 + 1000
    assert train_plan(config(source="auto"), "none").ledger.kl_offset == 1000
    explicit = DistillConfig(name="kl", offset=7)
    assert train_plan(config(distill=explicit), "stream").ledger.kl_offset == 7


def test_loss_direct_is_the_direct_mode_and_the_plan_is_frozen():
    plan = train_plan(config(loss="direct"), "stream")
    assert plan.mode == "direct" and plan.direct and plan.streams
    with pytest.raises(FrozenInstanceError):
        plan.source = "cache"
    with pytest.raises(ConfigError, match="not 'auto'"):
        train_plan(config(), "auto")


def test_num_tokens_all_reserves_the_sample_unless_the_source_is_the_cache():
    assert reserved_tokens(config(source="cache"), 50_000) == (0, 0)
    assert reserved_tokens(config(source="auto"), 50_000) == (8192, 0)
    cfg = replace(config(source="stream", cache_tokens=1000), distill=DistillConfig(name="kl", tokens=4096))
    assert reserved_tokens(cfg, 50_000) == (1000, 4096)
    assert reserved_tokens(cfg, 500) == (500, 4096)


def test_distill_and_finetune_are_switched_by_their_name_and_the_stages_list_only_says_how_far():
    from dofla.config import FinetuneConfig
    from dofla.stages.plan import stage_plan

    kl, lora = DistillConfig(name="kl"), FinetuneConfig(name="lora")
    assert {"distill", "finetune"}.isdisjoint(stage_plan(config()))  # listed by default, off by name
    assert {"distill", "finetune"} <= set(stage_plan(replace(config(distill=kl), finetune=lora)))
    early = replace(config(distill=kl), stages=["cache", "allocate", "train", "assemble"])
    assert stage_plan(early)[-1] == "assemble"  # the list ends before distill: a partial run
    with pytest.raises(ConfigError, match="runs eval but leaves out distill, which distill=kl turns on"):
        stage_plan(replace(config(distill=kl), stages=["cache", "allocate", "train", "assemble", "eval"]))
