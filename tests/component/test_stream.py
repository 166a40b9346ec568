"""Streaming layerwise training on a tiny Llama: it trains, exits early, matches the cache path."""
from __future__ import annotations

import copy
import random
import time

import pytest
import torch

from dofla.cache import build_or_load_cache
from dofla.data import DataError, build_source, pack_tokens
from dofla.data.prepared import source_stream
from dofla.data.stream import BatchStream, StreamExhausted
from dofla.feature_maps import build_feature_map
from dofla.models.capture import capture_qkv
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train.layerwise import LayerTrainConfig, train_layer
from dofla.train.stream import run_streaming, total_steps, train_layers_streaming
from dofla.train.teacher_acts import cache_heldout, teacher_heldout

WORDS = "the lord said unto moses and aaron go forth into land of light water day night".split()


def texts(num_docs: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(num_docs)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def teacher():
    return build_tiny_model("llama", seed=0, num_layers=3)


def feature_maps(num_layers: int = 3) -> list:
    return [build_feature_map("learned_prf", 4, 16, 16, seed=i) for i in range(num_layers)]


def stream(tokenizer, batch_size=2, seq_len=32, docs=None) -> BatchStream:
    docs = texts() if docs is None else docs
    return BatchStream(lambda: iter(docs), tokenizer, batch_size, seq_len, source="test")


def config(**overrides) -> LayerTrainConfig:
    return LayerTrainConfig(**{"batch_size": 2, "warmup_steps": 2, "eval_every": 5, **overrides})


def heldout(teacher, tokenizer, layers=(0, 1, 2)):
    rows = pack_tokens(iter(texts(10, seed=99)), tokenizer, seq_len=32, num_tokens=96)
    return teacher_heldout(teacher, rows, list(layers))


def test_batches_are_pack_tokens_rows_and_resume_exactly(tokenizer):
    docs = texts()
    reference = pack_tokens(iter(docs), tokenizer, seq_len=32, num_tokens=6 * 64)
    batches = stream(tokenizer)
    served = [batches.next_batch() for _ in range(3)]
    saved = batches.state()
    served += [batches.next_batch() for _ in range(3)]
    assert torch.equal(torch.cat(served), reference)
    resumed = stream(tokenizer)
    resumed.restore(saved)
    assert resumed.position == 3
    assert torch.equal(torch.cat([resumed.next_batch() for _ in range(3)]), reference[6:])
    skipped = stream(tokenizer)
    skipped.skip_to(4)
    assert torch.equal(skipped.next_batch(), reference[8:10])


def test_discard_skips_tokens_and_resumes(tokenizer):
    reference = pack_tokens(iter(texts()), tokenizer, seq_len=10, num_tokens=100 + 3 * 64).flatten()
    batches = stream(tokenizer)
    batches.discard(100)
    assert torch.equal(batches.next_batch().flatten(), reference[100:164])
    resumed = stream(tokenizer)
    resumed.restore(batches.state())
    assert torch.equal(resumed.next_batch().flatten(), reference[164:228])


def test_cache_heldout_reads_the_last_cached_sequences(teacher, tokenizer, tmp_path):
    rows = pack_tokens(iter(texts()), tokenizer, seq_len=32, num_tokens=5 * 32)
    cache = build_or_load_cache(teacher, rows, {"test": "stream"}, tmp_path, progress=False)
    got = cache_heldout(cache, num_seqs=2)(1)
    want = teacher_heldout(teacher, rows[-2:], [1])[1]
    assert [t.shape for t in got] == [t.shape for t in want] == [(2, 4, 32, 16), (2, 2, 32, 16), (2, 2, 32, 16)]
    assert all(torch.allclose(a, b, rtol=2e-3, atol=2e-3) for a, b in zip(got, want))  # q, k, v


def test_source_stream_reads_a_registered_source(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = texts(40)
    path.write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    batches = source_stream("text_files", {"paths": [str(path)], "heldout_fraction": 0.1}, tokenizer, 2, 16)
    train_docs = build_source("text_files", paths=[str(path)], heldout_fraction=0.1).texts("train")
    assert torch.equal(batches.next_batch(), pack_tokens(train_docs, tokenizer, 16, 32))


def test_stream_that_runs_out_raises_one_sentence(teacher, tokenizer):
    batches = stream(tokenizer, docs=texts(3))
    with pytest.raises(StreamExhausted):
        list(iter(batches.next_batch, None))
    cfg = config()
    with pytest.raises(DataError) as err:
        train_layers_streaming(teacher, stream(tokenizer, docs=texts(3)), feature_maps(), [0], cfg,
                               heldout(teacher, tokenizer, [0]), num_tokens=64 * 50, progress=False)
    message = str(err.value)
    assert "'test' ran out after" in message and "lower data.num_tokens" in message
    assert "\n" not in message and ". " not in message


def test_streaming_lowers_every_layers_heldout_loss(teacher, tokenizer):
    maps = feature_maps()
    result = train_layers_streaming(teacher, stream(tokenizer), maps, [0, 1, 2], config(),
                                    heldout(teacher, tokenizer), num_tokens=20 * 64, progress=False)
    assert result.tokens == 20 * 64 and result.steps_run == 20
    for i, summary in result.summaries.items():
        assert summary["steps_run"] == 20
        assert summary["final_heldout_loss"] < summary["initial_heldout_loss"] - 1e-3, (i, summary)
        evaluated = [c["heldout_loss"] for c in summary["curve"] if "heldout_loss" in c]
        assert len(evaluated) == 4 and min(evaluated) == summary["final_heldout_loss"]


def test_steps_wins_over_num_tokens():
    assert total_steps(10_000, None, 64) == 156
    assert total_steps(10_000, 7, 64) == 7
    with pytest.raises(ValueError, match="less than one batch"):
        total_steps(10, None, 64)


@pytest.mark.parametrize("layers", [[], [3], [-1, 0]])
def test_layers_outside_the_teacher_are_refused(teacher, tokenizer, layers):
    with pytest.raises(ValueError, match="non-empty subset of 0..2"):
        train_layers_streaming(teacher, stream(tokenizer), feature_maps(), layers, config(), {}, num_tokens=64)


def _count_forwards(module) -> list:
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_early_exit_and_layer_subset(teacher, tokenizer):
    held = heldout(teacher, tokenizer, [1])
    first, last = (_count_forwards(teacher.model.layers[j]) for j in (0, 2))
    maps = feature_maps()
    before = [copy.deepcopy(m.state_dict()) for m in maps]
    result = train_layers_streaming(teacher, stream(tokenizer), maps, [1], config(), held,
                                    num_tokens=3 * 64, progress=False)
    assert list(result.summaries) == [1]
    assert len(first) == 3 and len(last) == 0  # one teacher forward per step, stopped after layer 1
    for j in (0, 2):
        assert all(torch.equal(t, before[j][n]) for n, t in maps[j].state_dict().items())
    assert not all(torch.equal(t, before[1][n]) for n, t in maps[1].state_dict().items())


@pytest.mark.parametrize("loss", ["softmax", "output"])
def test_one_streaming_step_equals_the_cache_path_step(teacher, tokenizer, loss):
    """B = 1: train_layer always draws sequence 0, so both paths take the same Adam step on the same
    q, k (and v, which the ``output`` loss reads)."""
    tokens = stream(tokenizer, batch_size=1).next_batch()
    acts = capture_qkv(teacher, tokens)
    cfg = config(batch_size=1, steps=1, eval_every=1, loss=loss, window=8 if loss == "output" else 0)
    for i in range(3):
        cached = build_feature_map("learned_prf", 4, 16, 16, seed=i)
        reference = train_layer(cached, acts[i][0], acts[i][1], cfg, v=acts[i][2])
        maps = feature_maps()
        result = train_layers_streaming(teacher, stream(tokenizer, batch_size=1), maps, [i], cfg,
                                        {i: acts[i]}, num_tokens=32, progress=False)
        summary = result.summaries[i]
        assert summary["curve"][0]["loss"] == reference.curve[0]["loss"]
        assert summary["final_heldout_loss"] == reference.final_heldout_loss
        for name, value in maps[i].state_dict().items():
            assert torch.equal(value, reference.state_dict[name]), (i, name)


def test_run_streaming_writes_artifacts_and_reuses_them(teacher, tokenizer, tmp_path):
    maps = feature_maps()
    held = heldout(teacher, tokenizer)
    first = run_streaming(teacher, stream(tokenizer), maps, [0, 2], config(), held, tmp_path, {"run": 1},
                          num_tokens=4 * 64)
    assert sorted(p.name for p in tmp_path.glob("layer_*.pt")) == ["layer_00.pt", "layer_02.pt"]
    assert not list(tmp_path.glob("*.ckpt")) and first[0]["tokens"] == 4 * 64
    calls = _count_forwards(teacher.model.layers[0])
    fresh = feature_maps()
    again = run_streaming(teacher, stream(tokenizer), fresh, [0, 2], config(), held, tmp_path, {"run": 1},
                          num_tokens=4 * 64)
    assert not calls and again == first
    assert all(torch.equal(t, maps[2].state_dict()[n]) for n, t in fresh[2].state_dict().items())
    (tmp_path / "layer_02.pt").unlink()
    fresh = feature_maps()
    third = run_streaming(teacher, stream(tokenizer), fresh, [0, 2], config(), held, tmp_path, {"run": 1},
                          num_tokens=4 * 64)
    assert len(calls) == 4 and third[0] == first[0]  # only layer 2 retrained: 4 steps, same result
    untimed = [{k: v for k, v in summary.items() if k != "seconds"} for summary in (third[2], first[2])]
    assert untimed[0] == untimed[1]
    assert all(torch.equal(t, maps[2].state_dict()[n]) for n, t in fresh[2].state_dict().items())


def test_fineweb_edu_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        next(build_source("fineweb_edu").texts("train"))
    assert time.perf_counter() - start < 20
    message = str(err.value)
    assert "HuggingFaceFW/fineweb-edu (sample-10BT)" in message and "offline mode is set" in message
    assert "\n" not in message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_capture_teacher_matches_the_fp32_activations(dtype, teacher):
    """train.teacher_dtype: the copy's q, k, v against the fp32 teacher's (the plain reference)."""
    from dofla.stages.data import capture_teacher

    fp32 = teacher
    assert capture_teacher(fp32, "float32") is fp32
    half = capture_teacher(fp32, dtype)
    assert next(half.parameters()).dtype == getattr(torch, dtype)
    assert next(fp32.parameters()).dtype == torch.float32  # a copy: the evaluated teacher stays fp32
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    for want, got in zip(capture_qkv(fp32, ids), capture_qkv(half, ids)):
        for a, b in zip(want, got):
            error = (b.float() - a).norm() / a.norm()
            assert 0 < error < 3e-2, error  # rounded (not the same tensors), yet close


# the trainer fields the first stream checkpoints recorded (2026-11-23); later ones need a legacy value
FIRST_CHECKPOINT_FIELDS = {"loss", "loss_options", "steps", "batch_size", "lr_z", "lr_alpha", "lr_other", "warmup_steps",
                           "schedule", "heldout_fraction", "eval_every", "patience", "seed", "checkpoint_every",
                           "skip_nonfinite", "window"}


def test_every_trainer_field_added_since_the_first_checkpoints_is_declared():
    import dataclasses

    from dofla.config import NOT_LEARNT
    from dofla.train.layerwise import CHECKPOINT_LEGACY

    added = {f.name for f in dataclasses.fields(LayerTrainConfig)} - FIRST_CHECKPOINT_FIELDS
    assert added <= set(CHECKPOINT_LEGACY) | set(NOT_LEARNT), "give the new field a CHECKPOINT_LEGACY value"
    assert all(getattr(LayerTrainConfig(), k) == v for k, v in CHECKPOINT_LEGACY.items())  # the defaults reproduce


def test_a_checkpoint_written_before_later_trainer_fields_still_resumes(teacher, tokenizer, tmp_path, capsys):
    path, held = tmp_path / "stream.pt", heldout(teacher, tokenizer)
    first = train_layers_streaming(teacher, stream(tokenizer), feature_maps(), [0, 1, 2], config(checkpoint_every=2),
                                   held, checkpoint_path=path, num_tokens=4 * 64, progress=False)
    ckpt = torch.load(path, weights_only=False)
    old = {k: v for k, v in ckpt["meta"]["train"].items() if k in FIRST_CHECKPOINT_FIELDS}
    assert set(ckpt["meta"]["train"]) - set(old) == set()  # today's at their legacy values: not recorded
    for train, resumed in (({**old, "checkpoint_every": 2}, True), ({**old, "lr_z": 0.5}, False)):
        torch.save({**ckpt, "meta": {**ckpt["meta"], "train": train}}, path)
        again = train_layers_streaming(teacher, stream(tokenizer), feature_maps(), [0, 1, 2], config(checkpoint_every=2),
                                       held, checkpoint_path=path, num_tokens=4 * 64, progress=False)
        assert ("other settings" not in capsys.readouterr().out) == resumed
        if resumed:  # a finished run's checkpoint: the same result at once
            assert again.summaries[0]["final_heldout_loss"] == first.summaries[0]["final_heldout_loss"]
    from dataclasses import asdict

    from dofla.train.layerwise import learnt

    assert learnt(asdict(config(sinks=2, precision="bf16")))["precision"] == "bf16"  # off its legacy value: recorded
