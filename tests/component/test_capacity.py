"""The memory preflight (dofla.train.capacity): the peak predicted from 1- and 2-layer traces at
micro-batch 1 against the traced peak of the real step of the whole model at its real micro-batch."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from dofla.feature_maps import build_feature_map
from dofla.models import convert, get_adapter
from dofla.models.tiny import build_tiny_model
from dofla.train import LayerTrainConfig, capacity, train_direct
from dofla.train.layerwise import layer_loss, param_groups
from dofla.train.live import Live
from dofla.train.stream import _train_step


def test_the_tracker_counts_live_storage_and_its_peak():
    def step():
        a = torch.zeros(1024)  # 4 KiB
        b = torch.zeros(2048)  # 8 KiB: 12 KiB together
        del a
        c = b.view(2, 1024)  # a view: no new storage
        d = torch.zeros(256)  # 1 KiB, after a was freed
        return c, d

    with capacity.PeakTracker() as tracker:
        kept = step()
    assert tracker.peak == 12 * 1024 and tracker.live == 9 * 1024
    del kept


def full_stream_peak(teacher, maps, layers, cfg, batch: int, seq_len: int) -> int:
    modules = get_adapter(teacher).attention_modules(teacher)
    optimizers = {i: torch.optim.Adam(param_groups(maps[i], cfg)) for i in layers}
    lrs = {i: [g["lr"] for g in o.param_groups] for i, o in optimizers.items()}
    state = {"step": 0, "teacher_seconds": 0.0, "layers": {i: {"stopped": False, "seconds": 0.0, "curve": []}
                                                            for i in layers}}
    ids = torch.randint(0, teacher.config.vocab_size, (batch, seq_len))
    live = Live(None, 1, 0)
    traced = capacity.traced_peak(lambda: [_train_step(teacher, modules, ids, maps, optimizers, lrs, state, cfg, live)
                                           for _ in range(2)])
    return traced + capacity.module_bytes(teacher) + sum(capacity.module_bytes(maps[i]) for i in layers)


@pytest.mark.parametrize("loss", ["softmax", "l2", "output"])
@pytest.mark.parametrize("micro", [None, 2])
def test_the_streamed_step_peak_extrapolates_from_one_and_two_layers(loss, micro):
    teacher = build_tiny_model("llama", seed=0, num_layers=4)
    heads, d = teacher.config.num_attention_heads, teacher.config.hidden_size // teacher.config.num_attention_heads
    maps = [build_feature_map("learned_prf", heads, d, 16, seed=i) for i in range(4)]
    cfg = LayerTrainConfig(loss=loss, batch_size=4, micro_batch_size=micro)
    predicted = capacity.stream_step_peak(teacher, maps, [0, 1, 2, 3], cfg, seq_len=48)
    measured = full_stream_peak(teacher, [copy.deepcopy(m) for m in maps], [0, 1, 2, 3], cfg, 4, 48)
    assert predicted.micro_batch == (micro or 4)
    assert predicted.bytes == pytest.approx(measured, rel=0.1)


def test_under_bf16_the_trace_runs_the_teachers_bfloat16_copy_as_the_stream_does():
    teacher = build_tiny_model("llama", seed=0, num_layers=4)
    heads, d = teacher.config.num_attention_heads, teacher.config.hidden_size // teacher.config.num_attention_heads
    maps = [build_feature_map("learned_prf", heads, d, 16, seed=i) for i in range(4)]
    cfg = LayerTrainConfig(loss="softmax", batch_size=4, micro_batch_size=2, precision="bf16")
    copy16 = copy.deepcopy(teacher).to(torch.bfloat16)  # what dofla.stages.data hands the stream under bf16
    capture = capacity.module_bytes(copy16)
    predicted = capacity.stream_step_peak(teacher, maps, [0, 1, 2, 3], cfg, 48, capture, torch.bfloat16)
    measured = full_stream_peak(copy16, [copy.deepcopy(m) for m in maps], [0, 1, 2, 3], cfg, 4, 48)
    measured += capacity.module_bytes(teacher)  # the fp32 teacher stays loaded beside its copy
    assert predicted.bytes == pytest.approx(measured, rel=0.1)
    fp32 = capacity.stream_step_peak(teacher, maps, [0, 1, 2, 3], cfg, 48, capture)
    assert predicted.bytes < fp32.bytes  # the copy's activations are half the size


def test_the_direct_step_peak_extrapolates_from_one_and_two_layers(capsys):
    teacher = build_tiny_model("llama", seed=0, num_layers=4)

    def student_of(model):
        return convert(copy.deepcopy(model), feature_map="learned_prf", dims=[16] * model.config.num_hidden_layers)

    student = student_of(teacher)
    cfg = LayerTrainConfig(steps=2, batch_size=4, micro_batch_size=2)
    predicted = capacity.direct_step_peak(student_of, teacher, 4, cfg, 40, capacity.module_bytes(student))
    assert "train (direct)" not in capsys.readouterr().err  # the probe steps show no progress bar
    tokens = torch.randint(0, teacher.config.vocab_size, (8, 40))
    measured = capacity.traced_peak(lambda: train_direct(student, tokens, cfg)) + capacity.module_bytes(student)
    assert "train (direct)" in capsys.readouterr().err  # a real run does
    assert predicted.bytes == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("train", [["features", "attention"], ["lora"]])
def test_the_distill_step_peak_extrapolates_from_one_and_two_layers(train, capsys):
    from dofla.train.distill import DistillSchedule, train_kl

    teacher = build_tiny_model("llama", seed=0, num_layers=4)

    def student_of(model):
        return convert(copy.deepcopy(model), feature_map="hedgehog", dims=[16] * model.config.num_hidden_layers)

    student = student_of(teacher)
    s = DistillSchedule(steps=2, micro_batch_size=2, lr=1e-4, feature_lr=1e-3)
    weights = capacity.module_bytes(teacher) + capacity.module_bytes(student)
    predicted = capacity.kl_step_peak(student_of, teacher, 4, s, train, (4, 8), 40, weights, batch_size=4)
    assert predicted.stage == "distill" and predicted.micro_batch == 2
    assert "distill (KL)" not in capsys.readouterr().err  # the probe steps show no progress bar
    tokens = torch.randint(0, teacher.config.vocab_size, (4, 40))
    batches = type("Batches", (), {"batch_tokens": tokens.numel(), "next_batch": lambda self: tokens,
                                   "state": lambda self: {}, "restore": lambda self, state: None})()
    measured = capacity.traced_peak(lambda: train_kl(student, teacher, batches, train, s, lora=(4, 8))) + weights
    assert "distill (KL)" in capsys.readouterr().err  # a real run does
    assert predicted.bytes == pytest.approx(measured, rel=0.1)
    assert predicted.per_sample > 40 * teacher.config.vocab_size * 4  # at least the student's logits


def test_a_batch_of_one_sequence_is_traced_at_micro_batch_1_only(monkeypatch):
    """Batch 1 never runs a larger micro-batch: two traces (one and two layers) instead of four, and the
    same prediction at micro-batch 1 as the four-trace fit."""
    from dofla.train.distill import DistillSchedule

    teacher = build_tiny_model("llama", seed=0, num_layers=3)

    def student_of(model):
        return convert(copy.deepcopy(model), feature_map="hedgehog", dims=[16] * model.config.num_hidden_layers)

    traced, calls = capacity.traced_peak, []
    monkeypatch.setattr(capacity, "traced_peak", lambda step: calls.append(step) or traced(step))
    s = DistillSchedule(steps=2, micro_batch_size=None, lr=1e-4, feature_lr=1e-3)
    one = capacity.kl_step_peak(student_of, teacher, 3, s, ["features", "attention"], (4, 8), 40, 1000, batch_size=1)
    assert len(calls) == 2 and one.per_sample is None and one.micro_batch == 1
    both = capacity.kl_step_peak(student_of, teacher, 3, replace(s, micro_batch_size=1), ["features", "attention"],
                                 (4, 8), 40, 1000, batch_size=2)
    assert len(calls) == 6 and both.per_sample > 0
    assert one.bytes == pytest.approx(both.bytes, rel=1e-3)
    with pytest.raises(ValueError, match="micro-batch 1 only"):
        one.at(2).bytes


def test_the_largest_micro_batch_that_fits_divides_the_batch():
    peak = capacity.Peak("train", fixed=100, per_sample=10, micro_batch=8)
    assert peak.bytes == 180 and peak.at(2).bytes == 120
    assert capacity.largest_fitting(peak, 8, 150) == 4  # 5 would fit too, but does not divide 8
    assert capacity.largest_fitting(peak, 8, 105) is None


def smollm2_shaped(layers: int = 4):
    """SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, hidden 576, MLP 1536, vocab 49,152),
    random weights, ``layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=layers, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def test_at_smollm2_size_the_prediction_is_within_ten_percent_of_the_traced_step():
    teacher = smollm2_shaped()
    maps = [build_feature_map("learned_prf", 9, 64, 64, seed=i) for i in range(4)]
    cfg = LayerTrainConfig(loss="softmax", batch_size=4, micro_batch_size=2)
    predicted = capacity.stream_step_peak(teacher, maps, [0, 1, 2, 3], cfg, seq_len=256)
    measured = full_stream_peak(teacher, [copy.deepcopy(m) for m in maps], [0, 1, 2, 3], cfg, 4, 256)
    assert predicted.bytes == pytest.approx(measured, rel=0.1)
    assert predicted.per_sample > 10 * 2**20  # the L² loss terms dominate what a sequence costs


def test_the_cached_step_peak_is_one_layers_batch_and_loss():
    teacher = build_tiny_model("llama", seed=0, num_layers=2)
    geometry = get_adapter(teacher).geometry(teacher.config)
    maps = [build_feature_map("learned_prf", geometry.num_heads, geometry.head_dim, 16, seed=i) for i in range(2)]
    cfg = LayerTrainConfig(loss="l2", batch_size=4, micro_batch_size=4)
    predicted = capacity.cached_step_peak(teacher, maps, [0, 1], cfg, 48, geometry)
    fm = copy.deepcopy(maps[0])
    optimizer = torch.optim.Adam(param_groups(fm, cfg))

    def steps():
        for _ in range(2):
            q = torch.randn(4, geometry.num_heads, 48, geometry.head_dim)
            k = torch.randn(4, geometry.num_kv_heads, 48, geometry.head_dim)
            optimizer.zero_grad(set_to_none=True)
            layer_loss(fm, q, k, cfg).backward()
            optimizer.step()

    measured = capacity.traced_peak(steps) + capacity.module_bytes(teacher) + sum(map(capacity.module_bytes, maps))
    assert predicted.bytes == pytest.approx(measured, rel=0.1)


def tiny_run(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from dofla.cli import CONF_DIR, to_run_config
    from dofla.pipeline import run

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", f"paths.cache_dir={tmp_path / 'cache'}", "train.source=stream",
            "data.num_tokens=1024", "train.batch_size=8", "stages=[cache,allocate,train]", *overrides]))
    return run(cfg, tmp_path / "run")


def test_the_preflight_refuses_a_micro_batch_that_cannot_fit_and_names_one_that_does(tmp_path, capsys):
    from dofla.stages.preflight import DoesNotFitError

    tiny_run(tmp_path, "train.memory_limit_gb=1")  # fits: the prediction is printed, training runs
    out = capsys.readouterr().out
    assert "memory preflight" in out and "at micro-batch 8" in out and (tmp_path / "run" / "layers").exists()
    # a limit between the fixed part and the whole batch: refused before any training step, naming the fix
    record = json.loads((tmp_path / "run" / "preflight.json").read_text())["train"]
    assert record["predicted"] == record["fixed"] + 8 * record["per_sample"] and record["fits"] == 8
    limit = (record["fixed"] + 3 * record["per_sample"]) / 2**30  # micro-batch 2 fits, 4 does not
    with pytest.raises(DoesNotFitError, match=r"train.micro_batch_size=8 needs .* train.micro_batch_size=2 fits"):
        tiny_run(tmp_path / "refused", f"train.micro_batch_size=8", f"train.memory_limit_gb={limit}")
    tiny_run(tmp_path / "auto", "train.micro_batch_size=auto", f"train.memory_limit_gb={limit}")
    assert "train.micro_batch_size=auto: 2 (of batch 8)" in capsys.readouterr().out
    with pytest.raises(DoesNotFitError, match="even at micro-batch 1"):
        tiny_run(tmp_path / "tiny", "train.memory_limit_gb=1e-6")


def test_untrained_features_need_no_preflight_and_auto_trains_nothing(tmp_path, capsys):
    """Performer's features are random and fixed: there is no step to size, so auto is not an error."""
    tiny_run(tmp_path, "train.micro_batch_size=auto", "+variant=performer")
    out = capsys.readouterr().out
    assert "memory preflight" not in out and not (tmp_path / "run" / "preflight.json").exists()


def distill_run(tmp_path, *overrides):
    return tiny_run(tmp_path, "stages=[cache,allocate,train,assemble,distill]", "distill=kl", "distill.tokens=256",
                    "distill.batch_size=4", "distill.seq_len=64", *overrides)


@pytest.mark.long  # the distill stage's sizing through the whole stage (a minute); the train stage's sizing runs by default
def test_the_distill_stage_is_sized_before_training_and_auto_picks_its_micro_batch(tmp_path, capsys):
    from dofla.stages.preflight import DoesNotFitError

    distill_run(tmp_path)
    out = capsys.readouterr().out
    assert "the distill stage needs" in out and (tmp_path / "run" / "student_distilled").exists()
    record = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert set(record) == {"train", "distill"} and record["distill"]["fits"] == 4
    d = record["distill"]
    limit = (d["fixed"] + 3 * d["per_sample"]) / 2**30  # the distill stage fits at 2, not at 4
    t = record["train"]
    assert limit > (t["fixed"] + t["per_sample"]) / 2**30  # while the train stage fits at micro-batch 1
    fit = ["train.micro_batch_size=auto", f"train.memory_limit_gb={limit}"]
    with pytest.raises(DoesNotFitError, match=r"distill.micro_batch_size=4 needs .* distill.micro_batch_size=2 fits"):
        distill_run(tmp_path / "refused", "distill.micro_batch_size=4", *fit)
    assert not (tmp_path / "refused" / "run" / "layers").exists()  # refused before the train stage ran
    distill_run(tmp_path / "auto", "distill.micro_batch_size=auto", *fit)
    assert "distill.micro_batch_size=auto: 2 (of batch 4)" in capsys.readouterr().out
    assert (tmp_path / "auto" / "run" / "student_distilled").exists()
    with pytest.raises(DoesNotFitError, match="distill stage does not fit .* use distill.logit_chunk=256"):
        distill_run(tmp_path / "tiny", *fit[:1], f"train.memory_limit_gb={(t['fixed'] + t['per_sample']) / 2**30}")


def test_a_distill_batch_of_one_sequence_is_sized_whole(tmp_path, capsys):
    distill_run(tmp_path, "distill.batch_size=1")
    assert "the distill stage needs" in (out := capsys.readouterr().out) and "(a batch of one sequence)" in out
    d = json.loads((tmp_path / "run" / "preflight.json").read_text())["distill"]
    assert d["per_sample"] is None and d["predicted"] == d["fixed"] and d["fits"] == 1
    assert (tmp_path / "run" / "student_distilled").exists()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_what_stays_loaded_is_counted_without_building_the_student(arch):
    """The direct and distill predictions count teacher + student from the features alone (no copy of
    the teacher on the device just to weigh it)."""
    from dofla.feature_maps import build_layer_feature_map
    from dofla.stages.preflight import loaded_bytes

    teacher = build_tiny_model(arch, seed=0)
    g = get_adapter(teacher).geometry(teacher.config)
    maps = [build_layer_feature_map("hedgehog", g.num_heads, g.head_dim, 16, seed=i) for i in range(g.num_layers)]
    student = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[16] * g.num_layers)
    assert loaded_bytes(teacher, maps) == capacity.module_bytes(teacher) + capacity.module_bytes(student)
