"""The student's model card: how its lm-eval numbers were made, and a usage path a reader can use."""
from __future__ import annotations

import json
from pathlib import Path

from dofla.eval.store import Measurements, MEASUREMENTS
from dofla.models.card import lm_eval_settings, write_model_card

CONFIG = {"model_type": "dofla_student", "teacher_model_type": "llama", "_name_or_path": "/home/trainer/teacher",
          "dofla": {"attention": "linear", "feature_map": "hedgehog", "dims": [64, 64]},
          "dofla_run": {"teacher": "HuggingFaceTB/SmolLM2-135M-Instruct", "loss": "softmax", "allocation": "fix", "seed": 0}}
METRICS = {"eval/student_ppl": 52.3, "tasks/student/mmlu_dev_offline/acc": 0.214,
           "tasks/student/mmlu_dev_offline/acc_norm": 0.296, "tasks/student/avg_acc": 0.214,
           "tasks/teacher/mmlu_dev_offline/acc": 0.264, "tasks/teacher/mmlu_dev_offline/acc_norm": 0.279,
           "tasks/acc_gap": 0.05}
SETTINGS = {"lm_eval": "0.4.13", "tasks": ["mmlu_dev_offline"], "limit": None, "batch_size": 8}


def student_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run" / "student"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def test_the_card_pins_how_the_lm_eval_numbers_were_made(tmp_path):
    card = write_model_card(student_dir(tmp_path), METRICS, lm_eval=SETTINGS).read_text()
    assert "lm-eval 0.4.13" in card and "zero-shot (`num_fewshot=0`)" in card and "batch size 8" in card
    assert "every document of each task" in card and "no bootstrap" in card
    assert "| mmlu_dev_offline | not recorded | 0.214 | 0.296 | 0.264 | 0.279 |" in card
    assert "- `acc`: the share of questions whose choice of highest log-likelihood is the answer." in card
    assert "- `acc_norm`: the same, each choice's log-likelihood divided by its length in characters." in card
    assert "| held-out perplexity, student | 52.3 |" in card and "avg_acc" not in card


def test_a_limit_and_a_recorded_task_version_are_stated(tmp_path):
    metrics = {**METRICS, "tasks/student/mmlu_dev_offline/version": 1.0}
    card = write_model_card(student_dir(tmp_path), metrics, lm_eval={**SETTINGS, "limit": 6}).read_text()
    assert "the first 6 documents of each task" in card
    assert "| mmlu_dev_offline | 1.0 | 0.214 | 0.296 | 0.264 | 0.279 |" in card


def test_without_recorded_settings_the_card_says_so(tmp_path):
    card = write_model_card(student_dir(tmp_path), METRICS).read_text()
    assert "(version not recorded)" in card and "documents per task not recorded" in card


def test_a_card_without_task_scores_has_no_lm_eval_section(tmp_path):
    card = write_model_card(student_dir(tmp_path), {"eval/student_ppl": 52.3}).read_text()
    assert "## lm-eval scores" not in card


def test_the_usage_snippet_never_names_the_training_machines_path(tmp_path):
    directory = student_dir(tmp_path)
    card = write_model_card(directory, METRICS, name=str(directory.resolve())).read_text()
    assert str(tmp_path) not in card and "/home/trainer" not in card
    assert 'from_pretrained("path/to/student", trust_remote_code=True)' in card
    assert "`path/to/student` stands for this directory" in card
    card = write_model_card(directory, METRICS, name="you/smollm2-linear").read_text()
    assert 'from_pretrained("you/smollm2-linear", trust_remote_code=True)' in card and "path/to/" not in card


def test_lm_eval_settings_are_read_from_the_measurement_behind_the_runs_scores(tmp_path):
    run = tmp_path / "run"
    store = Measurements(run / MEASUREMENTS, main=True)
    scores = {k: v for k, v in METRICS.items() if k.startswith("tasks/student/")}
    store.get("tasks/student", {"model": "s", **SETTINGS, "limit": 6, "task_dirs": []}, lambda: {**scores, "tasks/student/avg_acc": 0.5})
    store.get("tasks/student", {"model": "s", **SETTINGS, "task_dirs": ["/x"]}, lambda: scores)
    store.get("tasks/teacher", {"model": "t", **SETTINGS, "batch_size": 2, "task_dirs": []}, lambda: {"tasks/teacher/avg_acc": 0.2})
    assert lm_eval_settings(run, METRICS) == SETTINGS
    assert lm_eval_settings(tmp_path / "elsewhere", METRICS) is None
    assert lm_eval_settings(run, {"eval/student_ppl": 52.3}) is None
