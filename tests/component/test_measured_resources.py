"""Predicted beside measured: the memory preflight of the evaluation protocol's task fine-tunes picks
their micro-batch, the startup estimate times every stage a cell runs (the teacher's grid once per
sweep) without moving the run's random state, and the stage timer records each stage's measured peak
memory and step time next to the prediction."""
from __future__ import annotations

import gc
import mmap
import re
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla import measure
from dofla.measure import StepClock, peak_memory, reset_rss_high_water, rss_peak
from dofla.stages import estimate, preflight
from dofla.stages.context import RunContext, StageTimer
from dofla.stages.plan import STREAM, train_plan
from dofla.tracking import NullTracker
from tests.conftest import write_local_tasks


def context(tmp_path, *overrides: str) -> RunContext:
    from dofla.models import get_adapter, load_teacher

    (tmp_path / "tasks").mkdir(exist_ok=True)
    tasks = write_local_tasks(tmp_path / "tasks")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", "eval.protocol=finetune", "eval.tasks=[piqa_local,arc_local]",
            f"eval.task_dirs=[{tasks}]", "eval.finetune_batch_size={default:8,arc_local:4}",
            "eval.finetune_max_length=48", *overrides]))
    teacher, tokenizer = load_teacher(cfg.model.source, seed=cfg.seed, num_layers=cfg.model.tiny_layers)
    geometry = get_adapter(teacher).geometry(teacher.config)
    plan = ("cache", "train", "assemble", "distill", "eval")
    return RunContext(cfg, tmp_path / "run", plan, teacher, tokenizer, geometry, teacher, train_plan(cfg, STREAM))


def limited(ctx: RunContext, gib: float) -> RunContext:
    import dataclasses

    train = dataclasses.replace(ctx.cfg.train, memory_limit_gb=gib)
    return dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, train=train))


def test_the_preflight_picks_each_tasks_fine_tune_micro_batch_and_refuses_one_that_does_not_fit(tmp_path, capsys):
    ctx = context(tmp_path, "eval.finetune_micro_batch_size=auto")
    dims = [16] * ctx.geometry.num_layers
    peak = preflight.predict_task_finetune(ctx, dims, 8)
    assert peak.per_sample > 0 and peak.fixed > 0
    between = (peak.at(2).bytes + peak.at(4).bytes) / 2 / 2**30  # room for 2 sequences, not for 4
    records = {}
    resolved = preflight.check_task_finetune(limited(ctx, between), dims, records)
    assert resolved.cfg.eval.finetune_micro_batch_size == {"piqa_local": 2, "arc_local": 2, "default": 2}
    assert records["eval"]["predicted"] == peak.at(2).bytes and records["eval"]["batch"] == {
        "piqa_local": 8, "arc_local": 4}
    assert "eval.finetune_micro_batch_size=auto: piqa_local 2, arc_local 2" in capsys.readouterr().out
    roomy = preflight.check_task_finetune(limited(ctx, peak.at(8).bytes * 1.01 / 2**30), dims, {})
    assert roomy.cfg.eval.finetune_micro_batch_size == {"piqa_local": None, "arc_local": None, "default": None}
    fixed = context(tmp_path, "eval.finetune_micro_batch_size=4")
    with pytest.raises(preflight.DoesNotFitError, match=r"piqa_local needs .* at micro-batch 4, more than .*"
                                                        r"eval.finetune_micro_batch_size=\{piqa_local: 2\} fits"):
        preflight.check_task_finetune(limited(fixed, between), dims, {})


def test_the_startup_estimate_times_every_stage_of_a_cell_and_leaves_the_random_state(tmp_path, capsys):
    ctx = context(tmp_path, "distill=kl", "distill.tokens=2048", "eval.finetune_train_limit=12",
                  "eval.finetune_lr_grid=[1e-4,1e-3,1e-2]", "eval.finetune_epochs=2")
    state = torch.get_rng_state()
    predicted = {}
    times = estimate.run(ctx, [16] * ctx.geometry.num_layers, ctx.plan, predicted)
    assert torch.equal(torch.get_rng_state(), state)
    assert [t.stage for t in times] == ["cache", "train", "distill", "eval_grid", "eval"]
    assert all(t.seconds > 0 for t in times) and set(predicted) == {t.stage for t in times}
    grid, student = times[-2:]
    assert grid.shared and not student.shared and grid.what == "the teacher's grid, 3 rates"
    out = capsys.readouterr().out
    assert re.search(r"predicted time on cpu .* this cell ≈ .*a sweep of n such cells ≈ n × .* \+ .*"
                     r"\(the teacher's grid once\)", out), out


def test_the_teachers_grid_counts_one_fine_tune_per_rate(tmp_path, monkeypatch):
    """Every step is given the same time (real steps' times differ run to run), so the arithmetic
    shows: the teacher's grid fine-tunes 3 rates where the student fine-tunes one."""
    ctx = context(tmp_path, "eval.finetune_train_limit=12", "eval.finetune_lr_grid=[1e-4,1e-3,1e-2]",
                  "eval.finetune_epochs=2")
    monkeypatch.setattr(estimate, "timed", lambda step, layers, micro, device: 0.25)
    grid, student = estimate.finetune_time(ctx, [16] * ctx.geometry.num_layers, torch.device("cpu"))
    assert student.seconds > 0 and grid.seconds == pytest.approx(3 * student.seconds)


def test_the_stage_timer_records_measured_peaks_and_step_times_beside_the_prediction(capsys):
    timer = StageTimer(torch.device("cpu"))
    tracker = timer.watch(NullTracker())
    timer.predicted.update({"train": {"predicted": 123456, "seconds": 9.0}})
    with timer("train"):
        blob = torch.ones(2**22)  # 16 MiB
        for step in (10, 20, 0, 5):  # 0: the next layer starts its steps again
            tracker.log({"train/step": step, "train/loss": 1.0})
            time.sleep(0.01)
    metrics = timer.metrics({"eval": 0.5})
    assert metrics["resources/train/peak_rss_bytes"] >= blob.numel() * 4
    assert metrics["resources/train/predicted_bytes"] == 123456 and metrics["resources/train/predicted_s"] == 9.0
    assert 0.0005 < metrics["resources/train/step_s"] < 0.05  # 15 steps in about 0.02 s
    assert metrics["resources/eval/step_s"] == 0.5
    out = capsys.readouterr().out
    if reset_rss_high_water():  # Linux: the stage's growth above the resident set it started with (the blob
        # itself may come from memory malloc already holds, so the growth is not bounded below here)
        start = metrics["resources/train/start_rss_bytes"]
        assert 0 < start <= metrics["resources/train/peak_rss_bytes"]
        grown = (metrics["resources/train/peak_rss_bytes"] - start) / 2**30
        assert f"the train stage grew the resident set by {grown:.2f} GiB" in out
    else:
        assert "the train stage peaked at" in out


def touched(mib: int):
    """``mib`` MiB of anonymous memory, every page written, handed back to the kernel when closed (mmap: no
    allocator keeps it after)."""
    block = mmap.mmap(-1, mib * 2**20)
    block.write(b"\1" * len(block))
    return block


@pytest.mark.skipif(not reset_rss_high_water(), reason="needs a resettable resident-set high-water mark (Linux)")
def test_peak_memory_on_the_cpu_is_each_scopes_own_peak_and_an_outer_scope_keeps_its_inner_ones():
    gc.collect()
    gc.disable()  # no collection of earlier tests' garbage may shrink the resident set inside a scope
    try:
        with peak_memory("cpu") as outer:
            with peak_memory("cpu") as big:
                touched(96).close()
            with peak_memory("cpu") as small:
                touched(8).close()
    finally:
        gc.enable()
    assert big["kind"] == small["kind"] == outer["kind"] == "rss"
    # each scope's growth above the resident set it began with is its own (a margin for pages the kernel
    # reclaims from a busy machine meanwhile)
    assert big["bytes"] - big["start"] >= 64 * 2**20 > small["bytes"] - small["start"] >= 0
    assert small["bytes"] <= big["bytes"] - 2**26  # the later, smaller scope does not carry the earlier peak
    assert outer["bytes"] >= big["bytes"] >= 96 * 2**20


def test_peak_memory_on_the_cpu_without_a_resettable_mark_is_the_process_peak(monkeypatch):
    monkeypatch.setattr(measure, "_PROC", Path("/nonexistent"))  # another OS: no /proc
    with peak_memory("cpu") as peak:
        torch.ones(2**23)  # 32 MiB
    assert peak["kind"] == "rss_process" and rss_peak() >= peak["bytes"] >= 2**25


def test_the_step_clock_passes_every_log_on():
    seen = []

    class Tracker:
        def log(self, values):
            seen.append(values)

        def finish(self):
            return "finished"

    clock = StepClock(Tracker())
    clock.log({"distill/step": 1, "distill/kl": 0.3})
    assert seen == [{"distill/step": 1, "distill/kl": 0.3}] and clock.finish() == "finished"
