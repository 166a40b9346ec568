"""The student's model card: how its lm-eval numbers were made, and a usage path a reader can use."""
from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard
from huggingface_hub import constants as hub_constants

from dofla.eval.store import Measurements, MEASUREMENTS
from dofla.models.card import lm_eval_settings, teacher_license, write_model_card

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
    assert "| mmlu_dev_offline | not recorded | `acc` | 0.214 | 0.264 |" in card
    assert "| mmlu_dev_offline | not recorded | `acc_norm` | 0.296 | 0.279 |" in card
    assert "- `acc`: the share of questions whose choice of highest log-likelihood is the answer." in card
    assert "- `acc_norm`: the same, each choice's log-likelihood divided by its length in characters." in card
    assert "| held-out perplexity, student | 52.3 |" in card and "avg_acc" not in card


def test_a_limit_and_a_recorded_task_version_are_stated(tmp_path):
    metrics = {**METRICS, "tasks/student/mmlu_dev_offline/version": 1.0}
    card = write_model_card(student_dir(tmp_path), metrics, lm_eval={**SETTINGS, "limit": 6}).read_text()
    assert "the first 6 documents of each task" in card
    assert "| mmlu_dev_offline | 1.0 | `acc` | 0.214 | 0.264 |" in card


def test_a_recall_tasks_own_metrics_are_shown_beside_the_teachers(tmp_path):
    metrics = {**METRICS, "tasks/student/niah_single_1/1024": 0.0, "tasks/student/niah_single_1/2048": 0.1,
               "tasks/teacher/niah_single_1/1024": 1.0}
    card = write_model_card(student_dir(tmp_path), metrics, lm_eval=SETTINGS).read_text()
    assert "| niah_single_1 | not recorded | `1024` | 0 | 1 |" in card
    assert "| niah_single_1 | not recorded | `2048` | 0.1 | – |" in card  # the teacher not scored there
    assert "- any other metric: the task's own score under lm-eval's name" in card
    plain = write_model_card(student_dir(tmp_path / "b"), METRICS, lm_eval=SETTINGS).read_text()
    assert "any other metric" not in plain


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


def test_the_scores_are_the_hubs_model_index(tmp_path):
    card = ModelCard.load(write_model_card(student_dir(tmp_path), METRICS, name="you/smollm2-linear", lm_eval=SETTINGS))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.library_name == "transformers"
    assert card.data.model_name == "smollm2-linear"
    found = {(r.dataset_type, r.metric_type): r for r in card.data.eval_results}
    assert {k: r.metric_value for k, r in found.items()} == {
        ("held-out", "perplexity"): 52.3, ("mmlu_dev_offline", "acc"): 0.214, ("mmlu_dev_offline", "acc_norm"): 0.296}
    assert found["mmlu_dev_offline", "acc"].dataset_args == {"num_fewshot": 0}
    assert found["mmlu_dev_offline", "acc"].metric_name == "acc (lm-eval 0.4.13)"
    assert "# Linear-attention student of HuggingFaceTB/SmolLM2-135M-Instruct" in card.text  # the body stays


def test_a_card_without_scores_has_no_model_index(tmp_path):
    card = ModelCard.load(write_model_card(student_dir(tmp_path)))
    assert card.data.eval_results is None and "model-index" not in card.content


def _teacher_card(directory: Path, licence: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "README.md").write_text(f"---\nlicense: {licence}\n---\n# a teacher\n")


def test_the_licence_is_the_teachers_from_its_local_card(tmp_path):
    teacher = tmp_path / "teacher"
    _teacher_card(teacher, "llama3.2")
    directory = student_dir(tmp_path)
    config = {**CONFIG, "dofla_run": {**CONFIG["dofla_run"], "teacher": str(teacher)}}
    (directory / "config.json").write_text(json.dumps(config))
    card = ModelCard.load(write_model_card(directory, METRICS))
    assert card.data.license == "llama3.2" and "| licence | llama3.2 (the teacher's) |" in card.text
    assert card.data.base_model is None  # a local path is no hub repository


def test_the_licence_of_a_hub_teacher_is_read_from_the_local_hub_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    _teacher_card(repo / "snapshots" / "abc123", "apache-2.0")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert teacher_license("HuggingFaceTB/SmolLM2-135M-Instruct") == "apache-2.0"
    assert teacher_license("HuggingFaceTB/SmolLM2-135M-Instruct", revision="abc123") == "apache-2.0"
    directory = student_dir(tmp_path)
    card = ModelCard.load(write_model_card(directory, METRICS))
    assert card.data.license == "apache-2.0"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    card = ModelCard.load(write_model_card(directory, METRICS))
    assert card.data.license is None and "| licence | not found: see the teacher's own card |" in card.text


def test_the_card_imports_nothing_above_the_models_layer():
    import ast

    import dofla.models.card as card_module

    tree = ast.parse(Path(card_module.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [m for m in imported if m and m.startswith(("dofla.eval", "dofla.stages", "dofla.pipeline"))]
