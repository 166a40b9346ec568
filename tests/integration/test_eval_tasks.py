"""lm-eval tasks, the fine-tune protocol and MQAR through the real ``dofla`` command (tiny Llama).

Local JSON tasks stand in for the hub datasets; the hub ones are asked for with an empty cache
in offline mode, so the "cannot be downloaded" path is the same on every machine.
"""
from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from tests.conftest import write_local_tasks
from tests.integration.test_pipeline import run_cli


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _args(tmp_path, *extra: str) -> list[str]:
    return ["experiment=smoke_tiny", f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}",
            *extra]


def test_tasks_protocol_and_mqar_in_one_run(tmp_path, offline_env):
    (tmp_path / "tasks").mkdir()
    tasks = write_local_tasks(tmp_path / "tasks")
    result = run_cli(*_args(
        tmp_path, "eval.tasks=[piqa_local,mmlu_dev_offline,piqa]", f"eval.task_dirs=[{tasks}]",
        "eval.task_limit=6", "eval.protocol=finetune", "eval.finetune_lr_grid=[1e-4,1e-3]",
        "eval.finetune_epochs=2", "eval.finetune_train_limit=8", "eval.mqar=true",
        "eval.mqar_seq_lens=[16,32]", "eval.mqar_examples=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    for who in ("teacher", "student"):
        for task in ("piqa_local", "mmlu_dev_offline"):
            for metric in ("acc", "acc_norm"):
                assert 0 <= metrics[f"tasks/{who}/{task}/{metric}"] <= 1
        assert metrics[f"tasks/{who}/avg_acc"] == pytest.approx(
            (metrics[f"tasks/{who}/piqa_local/acc"] + metrics[f"tasks/{who}/mmlu_dev_offline/acc"]) / 2)
        assert set(k for k in metrics if k.startswith(f"mqar/{who}/")) == {f"mqar/{who}/T16", f"mqar/{who}/T32"}
    # each example's share is kept for the run's record, and averages to the scalar
    sequences = {k: v for stored in json.loads((run / "eval_sequences.json").read_text()).values() for k, v in stored.items()}
    for who in ("teacher", "student"):
        for length in (16, 32):
            shares = sequences[f"seq/mqar/{who}/T{length}"]
            assert len(shares) == 4 and metrics[f"mqar/{who}/T{length}"] == pytest.approx(sum(shares) / 4)
    assert metrics["tasks/acc_gap"] == pytest.approx(metrics["tasks/teacher/avg_acc"] - metrics["tasks/student/avg_acc"])
    # the protocol: a learning rate picked on the teacher from the grid, both models fine-tuned
    assert metrics["finetuned/lr/piqa_local"] in (1e-4, 1e-3)
    assert {"finetuned/teacher/piqa_local/acc", "finetuned/student/piqa_local/acc"} <= set(metrics)
    # piqa from the hub cannot be had: one sentence, the run went on
    skipped = json.loads((run / "tasks_skipped.json").read_text())
    assert set(skipped) == {"piqa", "finetune/mmlu_dev_offline"} and "cannot be downloaded" in skipped["piqa"]
    assert "no training split" in skipped["finetune/mmlu_dev_offline"]
    assert "downstream task piqa skipped" in result.stdout
    assert "mmlu_dev_offline" in (run / "report.md").read_text()
    # the student's card says how its task scores were made, and names no path of this machine
    card = (run / "student" / "README.md").read_text()
    assert f"lm-eval {version('lm_eval')}," in card and "zero-shot (`num_fewshot=0`), batch size 8" in card
    assert "the first 6 documents of each task" in card and str(tmp_path) not in card
    for metric in ("acc", "acc_norm"):  # the task version lm-eval reported, the student's and the teacher's score
        student, teacher = metrics[f"tasks/student/piqa_local/{metric}"], metrics[f"tasks/teacher/piqa_local/{metric}"]
        assert f"| piqa_local | 2.0 | `{metric}` | {student:.4g} | {teacher:.4g} |" in card


@pytest.mark.long
def test_only_unavailable_tasks_asked_stops_before_any_model_loads(tmp_path, offline_env):
    result = run_cli(*_args(tmp_path, "eval.tasks=[piqa,wsc]", "eval.perplexity=false",
                            "eval.attention_error=false"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "none of eval.tasks ['piqa', 'wsc'] can run here" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "cache").exists()


@pytest.mark.long
def test_unknown_task_name_is_one_sentence(tmp_path):
    result = run_cli(*_args(tmp_path, "eval.tasks=[piqaa]"))
    assert result.returncode == 2
    assert "unknown lm-eval task(s) ['piqaa']" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.long
def test_teacher_scores_are_computed_once_per_teacher(tmp_path):
    (tmp_path / "tasks").mkdir()
    tasks = write_local_tasks(tmp_path / "tasks")
    common = ["experiment=smoke_tiny", f"paths.cache_dir={tmp_path / 'cache'}", "eval.tasks=[piqa_local,mmlu_dev_offline]",
              f"eval.task_dirs=[{tasks}]", "eval.task_limit=4"]
    first = run_cli(*common, "allocation=fix", f"hydra.run.dir={tmp_path / 'fix'}")
    second = run_cli(*common, "allocation=dof", f"hydra.run.dir={tmp_path / 'dof'}")
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-3000:]
    assert "teacher task scores reused" not in first.stdout and "teacher task scores reused" in second.stdout
    m1, m2 = (json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("fix", "dof"))
    teacher = {k: v for k, v in m1.items() if k.startswith("tasks/teacher/")}
    assert teacher and teacher == {k: v for k, v in m2.items() if k.startswith("tasks/teacher/")}


def test_recall_suite_runs_what_it_can_and_says_why_for_the_rest(tmp_path, offline_env):
    """eval=recall_suite offline on the tiny Llama (a 512-token context): every task skipped with its own
    reason (RULER's needles cannot fit 1K, the others' hub data cannot be had), the MQAR probe still runs."""
    result = run_cli(*_args(tmp_path, "eval=recall_suite", "eval.tasks=[recall_suite]", "eval.mqar_seq_lens=[16]",
                            "eval.mqar_examples=2", "eval.perplexity=false", "eval.attention_error=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    skipped = json.loads((run / "tasks_skipped.json").read_text())
    assert set(skipped) == {"niah_single_1", "niah_single_2", "niah_single_3", "swde", "fda", "squad_completion"}
    for task in ("swde", "fda", "squad_completion"):
        assert "hazyresearch/based-" in skipped[task] and "cannot be downloaded" in skipped[task]
    # with RULER's packages the needle task is planned without any hub probe and stopped by the context;
    # without them it names the package
    assert ("none of its lengths [1024, 2048" in skipped["niah_single_1"] and "context of 512 tokens" in skipped["niah_single_1"]
            or "No module named 'wonderwords'" in skipped["niah_single_1"]), skipped["niah_single_1"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"mqar/teacher/T16", "mqar/student/T16"} <= set(metrics)
