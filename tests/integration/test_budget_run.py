"""``allocation=budget budget=memory`` through the real ``dofla`` command on a tiny Llama of four KV heads and
a tiny menu, trained from the cache and from a stream: the allocator measures every option at every KV head
on training tokens and spends the budget, the chosen student trains layerwise and then with KL and decodes in
the memory its plan predicts (within the budget), and a rerun reuses the allocation."""
from __future__ import annotations

import json

import pytest
import torch

from dofla.dof.sensitivity import head_values
from dofla.dof.sizing import nearest_state
from dofla.models import load_student
from dofla.models.plan import StudentPlan
from dofla.models.tiny import build_byte_tokenizer
from studies import budget_menu
from tests.component.test_mixed_heads import _teacher
from tests.integration.test_pipeline import run_cli

CONTEXT = 128
# 2,411 bytes at 128 tokens: below every head at the baseline window (8 × 325 bytes: 5 positions of one KV
# head's key and value), above every head at the smallest state (8 × 256), so the solver must give some heads a
# state
MIB = 0.0023
KV_HEADS, LAYERS = 4, 2
SOURCES = ("cache", "stream")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both training sources in one CLI start, twice (the second finds every artifact)."""
    root = tmp_path_factory.mktemp("budget_run")
    teacher = root / "teacher"
    _teacher().save_pretrained(teacher)
    build_byte_tokenizer().save_pretrained(teacher)
    args = ["-m", "experiment=smoke_tiny", f"model.source={teacher}", "allocation=budget", "budget=memory",
            f"budget.mib={MIB}", f"budget.context={CONTEXT}", "budget.windows=[4,8]", "budget.sinks=2",
            "budget.states=[4,8]", "budget.fit_steps=2", "budget.calibration_seqs=2", "budget.prompts=2",
            "budget.prompt_length=120", "loss=output", "distill=kl", "distill.tokens=2048",
            f"train.source={','.join(SOURCES)}", "hydra.sweep.subdir=${train.source}",
            f"paths.cache_dir={root / 'cache'}"]
    first = run_cli(*args, f"hydra.sweep.dir={root / 'runs'}")
    assert first.returncode == 0, first.stderr[-3000:]
    allocations = {s: json.loads((root / "runs" / s / "allocation.json").read_text()) for s in SOURCES}
    again = run_cli(*args, f"hydra.sweep.dir={root / 'runs'}")  # the same directories: every artifact found
    assert again.returncode == 0, again.stderr[-3000:]
    elsewhere = run_cli(*args, f"hydra.sweep.dir={root / 'elsewhere'}")  # the shared allocation found
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    return {source: {"dir": root / "runs" / source, "allocation": allocations[source], "first": first,
                     "again": again, "elsewhere": elsewhere, "other_dir": root / "elsewhere" / source,
                     "args": args, "root": root}
            for source in SOURCES}


def test_one_option_per_kv_head_within_the_budget(runs):
    for run in runs.values():  # both runs of each CLI start
        record = run["allocation"]
        assert [(h["layer"], h["kv_head"]) for h in record["heads"]] == [(i, k) for i in range(LAYERS)
                                                                          for k in range(KV_HEADS)]
        assert all(h["option"] in record["menu"] for h in record["heads"])
        prices = record["settings"]["prices"]  # keyed on: each option's bytes as the code counts them
        assert all(h["bytes"] == prices[record["menu"].index(h["option"])] for h in record["heads"])
        assert len(record["menu"]) == 9  # exact, w4, w8 each bare and with delta 4 and 8, delta 4 and 8
        assert record["budget"]["context"] == CONTEXT and record["solver"]["status"] == "optimal"
        assert record["budget"]["bytes"] == int(MIB * 2**20)
        assert record["budget"]["given"] == {"mib": MIB, "share": None}
        assert record["baseline"] == "w4+s2" and record["budget"]["bytes"] < LAYERS * KV_HEADS * 384
        assert any(h["plan"].get("state", "none") != "none" for h in record["heads"])  # forced by the budget
        assert 0 < record["plan_bytes"] <= record["budget"]["bytes"]
        assert record["slack_bytes"] == record["budget"]["bytes"] - record["plan_bytes"]
        assert record["cost"]["seconds"] > 0 and record["cost"]["students"] >= LAYERS * KV_HEADS * 8
        assert record["calibration"] == {"sequences": 2, "seq_len": 64, "prompts": 2, "prompt_length": 120}
        plan = StudentPlan.from_list(record["plan"])
        assert json.loads((run["dir"] / "plan.json").read_text()) == plan.to_list()
    # the stream's calibration sequences are the cache's (the same training text): its job finds the allocation
    first = runs["cache"]["first"].stdout
    assert first.count("dofla: allocation=budget: measured") == 1 and first.count("allocation=budget: reused") == 1
    assert runs["cache"]["allocation"] == runs["stream"]["allocation"]


def test_the_chosen_student_trains_layerwise_and_with_kl(runs):
    for source, run in runs.items():  # both runs of each CLI start
        assert json.loads((run["dir"] / "run.json").read_text())["train_source"] == source
        record, metrics = run["allocation"], json.loads((run["dir"] / "metrics.json").read_text())
        with_state = sorted({h["layer"] for h in record["heads"] if h["plan"].get("state", "none") != "none"})
        summary = json.loads((run["dir"] / "train_summary.json").read_text())
        assert sorted(summary) == [f"layer_{i:02d}" for i in with_state]
        assembled, distilled = load_student(run["dir"] / "student"), load_student(run["dir"] / "student_distilled")
        assert distilled.config.dofla["plan"] == assembled.config.dofla["plan"] == record["plan"]
        before = dict(assembled.named_parameters())
        moved = {int(name.split(".layers.")[1].split(".")[0]) for name, p in distilled.named_parameters()
                 if ".dofla." in name and not torch.equal(p, before[name])}
        assert metrics["distill/tokens"] == 2048 and moved == set(with_state)  # KL moved every layer's state
        assert metrics["allocation/cost_s"] == record["cost"]["seconds"] == metrics["allocation/menu_s"]
        assert metrics["allocation/menu_reused"] == 0.0


def test_measured_decode_memory_is_the_plans_and_within_the_budget(runs):
    for run in runs.values():  # both runs of each CLI start
        record, metrics = run["allocation"], json.loads((run["dir"] / "metrics.json").read_text())
        measured = metrics[f"memory/student/decode_mib/T{CONTEXT}"]
        assert measured == metrics[f"memory/student/plan_mib/T{CONTEXT}"] == record["plan_bytes"] / 2**20
        assert measured == metrics[f"allocation/plan_mib/T{CONTEXT}"] <= metrics[f"memory/budget_mib/T{CONTEXT}"]
        assert metrics[f"memory/budget_mib/T{CONTEXT}"] == record["budget"]["mib"]


def test_a_rerun_reuses_the_allocation_and_another_run_of_the_same_settings_shares_it(runs):
    for run in runs.values():  # both runs of each CLI start
        for start, directory in (("again", run["dir"]), ("elsewhere", run["other_dir"])):
            assert json.loads((directory / "allocation.json").read_text()) == run["allocation"]
            assert json.loads((directory / "plan.json").read_text()) == run["allocation"]["plan"]
            assert run[start].stdout.count("dofla: allocation=budget: reused") == 2, start
            assert "dofla: allocation=budget: measured" not in run[start].stdout
        metrics = json.loads((run["other_dir"] / "metrics.json").read_text())
        assert metrics["allocation/cost_s"] == run["allocation"]["cost"]["seconds"]
        assert "allocation/share_of_training" not in metrics  # measured by another run


def test_another_budget_solves_on_the_measured_menu(runs):
    """A larger budget and the copying signal on the same teacher, menu and calibration text: the menu's
    measurement, put back from the first run's record as a fresh machine would (studies/budget_menu.py), is
    found and only the chosen plan is measured; the record and the metrics say so."""
    run = runs["cache"]
    first = run["allocation"]
    kept = run["root"] / "cache" / "allocations" / first["menu_measurement"]["file"]
    original = json.loads(kept.read_text())
    kept.unlink()
    budget_menu.main([str(run["dir"] / "allocation.json"), "--cache-dir", str(run["root"] / "cache")])
    assert json.loads(kept.read_text()) == original
    args = [a for a in run["args"] if not a.startswith(("budget.mib=", "train.source=", "hydra.sweep.subdir="))]
    root = run["root"] / "larger"
    done = run_cli(*args, f"budget.mib={2 * MIB}", "budget.copy_weight=0.5", "train.source=cache", "distill=none",
                   "stages=[cache,allocate]", f"hydra.sweep.dir={root}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dofla: allocation=budget: solved on the menu measured before" in done.stdout
    record = json.loads((root / "0" / "allocation.json").read_text())
    assert record["weights"]["copying"] == 0.5 and record["copying"]["heads"] == first["copying"]["heads"]
    measured = {"base": first["base_signals"], "signals": first["signals"]}
    assert record["values"] == head_values(measured, 1.0, 1.0, record["copying"], 0.5)
    assert record["menu_measurement"]["reused"] and not first["menu_measurement"]["reused"]
    assert record["menu_measurement"]["seconds"] == first["cost"]["seconds"]
    assert record["signals"] == first["signals"] and record["cost"]["students"] == 1
    assert record["budget"]["bytes"] == int(2 * MIB * 2**20) >= record["plan_bytes"] > first["plan_bytes"]


def test_states_sized_by_dof_read_the_dof_stage_and_solve_on_the_measured_menu(runs):
    """budget.state_sizing=dof: the stage graph adds the dof stage, each KV head's DoF is the mean of its query
    heads' from dof.json, the menu measured by the first run is solved on again, and every state the plan keeps
    has the M nearest to the chosen scale × its head's DoF."""
    run = runs["cache"]
    first = run["allocation"]
    args = [a for a in run["args"] if not a.startswith(("train.source=", "hydra.sweep.subdir="))]
    root = run["root"] / "sized"
    done = run_cli(*args, "budget.state_sizing=dof", "train.source=cache", "distill=none",
                   "stages=[cache,allocate]", f"hydra.sweep.dir={root}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dofla: allocation=budget: solved on the menu measured before" in done.stdout
    record = json.loads((root / "0" / "allocation.json").read_text())
    per_head = json.loads((root / "0" / "dof.json").read_text())["per_head"]
    group = len(per_head[0]) // KV_HEADS
    dof = [sum(layer[j * group:(j + 1) * group]) / group for layer in per_head for j in range(KV_HEADS)]
    sizing = record["state_sizing"]
    assert sizing["name"] == "dof" and sizing["unit_dof"] == pytest.approx(dof, rel=1e-12)
    assert record["settings"]["dof"] == sizing["unit_dof"] and record["signals"] == first["signals"]
    assert sizing["sizes"] == [nearest_state(sizing["scale"] * d, [4, 8]) for d in dof]
    kept = [(h["plan"]["M"], m) for h, m in zip(record["heads"], sizing["sizes"]) if h["plan"]["state"] != "none"]
    assert all(a == b for a, b in kept)
    assert first["state_sizing"]["name"] == "measured" and "dof" not in first["settings"]


def test_a_menu_with_another_window_measures_that_window_alone(runs):
    """budget.windows=[4,8,12] on the teacher and calibration of the first run: the options of the first menu are
    taken from its measurement (the record says which, and the menu's seconds count both), only the new
    window's options are measured, and the shared options' signals are the first run's."""
    run = runs["cache"]
    first = run["allocation"]
    args = [a for a in run["args"] if not a.startswith(("budget.windows=", "train.source=", "hydra.sweep.subdir="))]
    root = run["root"] / "wider"
    done = run_cli(*args, "budget.windows=[4,8,12]", "train.source=cache", "distill=none", "stages=[cache,allocate]",
                   f"hydra.sweep.dir={root}")
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((root / "0" / "allocation.json").read_text())
    extends = record["menu_measurement"]["extends"]
    assert extends["file"] == first["menu_measurement"]["file"] and extends["shared"] == first["menu"]
    assert "options' signals taken from the menu measured before" in done.stdout
    new = [name for name in record["menu"] if name not in first["menu"]]
    assert new == ["w12+s2", "w12+s2+delta4", "w12+s2+delta8"]
    units = LAYERS * KV_HEADS
    assert record["cost"]["reused"] == units * (len(first["menu"]) - 1)
    assert record["cost"]["students"] == 1 + units * len(new) + len(record["checks"])  # + the chosen plans' checks
    assert record["menu_measurement"]["seconds"] == pytest.approx(record["cost"]["seconds"] + extends["seconds"])
    for mine, theirs in zip(record["signals"], first["signals"], strict=True):
        assert [mine[record["menu"].index(name)] for name in first["menu"]] == theirs
