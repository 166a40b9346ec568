"""The paper's fine-tune protocol: the teacher's grid search kept once per teacher and reused by every
cell of a sweep, per-task batch sizes, and its settings checked before anything loads."""
from __future__ import annotations

import copy
import re

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.eval import suite, task_finetune
from dofla.eval.downstream import DownstreamUnavailable
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.validate import ConfigError, validate_config
from tests.conftest import write_local_tasks


def tiny(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["experiment=smoke_tiny", *overrides]))


@pytest.fixture
def spy(monkeypatch):
    """Every (model, task, lr) fine-tuned, recorded while the real fine-tune runs."""
    calls = []
    real = task_finetune.finetune_and_score

    def recorded(model, tokenizer, task, pairs, lr, cfg, *rest):
        calls.append((model, task, lr, cfg.batch_for(task)))
        return real(model, tokenizer, task, pairs, lr, cfg, *rest)

    monkeypatch.setattr(task_finetune, "finetune_and_score", recorded)
    return calls


@pytest.mark.long  # the grid shared by two processes runs by default (test_finetune_protocol_resume.py)
def test_the_teachers_grid_search_runs_once_and_every_cell_reuses_it(tmp_path, spy, byte_tokenizer, capsys):
    (tmp_path / "tasks").mkdir()
    tasks = write_local_tasks(tmp_path / "tasks")
    overrides = ["eval.protocol=finetune", "eval.tasks=[piqa_local,arc_local]", f"eval.task_dirs=[{tasks}]",
                 "eval.finetune_lr_grid=[1e-4,1e-3]", "eval.finetune_epochs=1", "eval.finetune_train_limit=8",
                 "eval.task_limit=6", "eval.finetune_batch_size={default:4,arc_local:2}"]
    cfg = tiny(*overrides)
    validate_config(cfg)
    plan = suite.plan_tasks(cfg.eval, tmp_path / "run", others_requested=False)
    teacher = build_tiny_model("gpt2", seed=0)
    cells = [convert(copy.deepcopy(teacher), feature_map=fm) for fm in ("learned_prf", "hedgehog")]
    first = suite.finetune_protocol(teacher, cells[0], byte_tokenizer, plan, cfg, tmp_path / "kept")
    teacher_calls = [c for c in spy if c[0] is teacher]
    assert sorted((t, lr) for _, t, lr, _ in teacher_calls) == sorted(
        (t, lr) for t in ("piqa_local", "arc_local") for lr in (1e-4, 1e-3))  # the grid, on the teacher
    assert {(t, b) for _, t, _, b in spy} == {("piqa_local", 4), ("arc_local", 2)}  # per-task batch sizes
    spy.clear()
    second = suite.finetune_protocol(teacher, cells[1], byte_tokenizer, plan, cfg, tmp_path / "kept")
    assert all(model is cells[1] for model, *_ in spy) and len(spy) == 2  # only the student, once per task
    assert "fine-tune protocol (learning rates and scores) reused" in capsys.readouterr().out
    for task in ("piqa_local", "arc_local"):
        assert first[f"finetuned/lr/{task}"] == second[f"finetuned/lr/{task}"]
        assert first[f"finetuned/teacher/{task}/acc"] == second[f"finetuned/teacher/{task}/acc"]
    assert "finetuned/student/avg_acc" in second
    spy.clear()  # another protocol setting is another teacher result
    other = tiny(*overrides, "eval.finetune_max_length=64")
    suite.finetune_protocol(teacher, cells[1], byte_tokenizer, plan, other, tmp_path / "kept")
    assert any(model is teacher for model, *_ in spy)


@pytest.mark.parametrize("override, message", [
    ("eval.finetune_batch_size=0", "eval.finetune_batch_size.default=0"),
    ("eval.finetune_batch_size={piqa:-1}", "eval.finetune_batch_size.piqa=-1"),
    ("eval.finetune_max_length=0", "eval.finetune_max_length=0"),
])
def test_bad_protocol_settings_are_one_sentence(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny(override))


def test_a_task_without_a_training_split_trains_on_the_data_given_for_it(tmp_path, spy, byte_tokenizer, capsys):
    """MMLU's case, on the offline MMLU-dev task (a test split only): skipped and said without
    eval.finetune_train_data, trained on the given rows in the task's own prompt format with it."""
    import json

    from dofla.eval.mmlu_dev import write_mmlu_dev_task

    task = write_mmlu_dev_task(tmp_path / "tasks")
    aux = tmp_path / "aux.jsonl"
    aux.write_text("".join(json.dumps({"question": f"Which is item {i}?", "subject": "", "choices": ["w", "x", "y", "z"],
                                       "answer": i % 4}) + "\n" for i in range(10)))
    base = ["eval.protocol=finetune", f"eval.tasks=[{task}]", f"eval.task_dirs=[{tmp_path / 'tasks'}]",
            "eval.finetune_lr_grid=[1e-3]", "eval.finetune_epochs=1", "eval.finetune_train_limit=6", "eval.task_limit=4"]
    teacher = build_tiny_model("gpt2", seed=0)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf")
    cfg = tiny(*base)
    plan = suite.plan_tasks(cfg.eval, tmp_path / "run", others_requested=False)
    without = suite.finetune_protocol(teacher, student, byte_tokenizer, plan, cfg)
    assert not spy and f"finetuned/teacher/{task}/acc" not in without
    assert f"give one with eval.finetune_train_data.{task}" in capsys.readouterr().out

    cfg = tiny(*base, f"eval.finetune_train_data={{{task}:{{files:['{aux}']}}}}")
    validate_config(cfg)
    pairs = task_finetune.training_pairs(task, teacher, byte_tokenizer, plan.task_dirs, 6, cfg.eval.finetune_train_data[task])
    assert len(pairs) == 6  # eval.finetune_train_limit rows of the given data
    context, continuation = (byte_tokenizer.decode(ids) for ids in pairs[1])
    assert context == "Which is item 1?\nAnswer:" and continuation == " x"  # the task's prompt; the gold choice
    with_data = suite.finetune_protocol(teacher, student, byte_tokenizer, plan, cfg)
    assert {(t, lr) for _, t, lr, _ in spy} == {(task, 1e-3)} and len(spy) == 2  # teacher and student
    assert f"finetuned/teacher/{task}/acc" in with_data and f"finetuned/student/{task}/acc" in with_data


@pytest.mark.parametrize("spec, message", [
    ("{files:['/no/such.jsonl']}", "names files that do not exist: /no/such.jsonl"),
    ("{path:x,files:['/a']}", "must be {path, name, split} (a hub dataset) or {files: [...]}"),
    ("{url:x}", "must be {path, name, split}"),
    (None, "eval.finetune_train_data='x' must map task names to training data"),
])
def test_bad_training_data_settings_fail_before_loading(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        value = "x" if spec is None else f"{{mmlu:{spec}}}"
        validate_config(tiny("eval.protocol=finetune", "eval.tasks=[mmlu]", f"eval.finetune_train_data={value}"))


def test_training_data_that_cannot_be_fetched_is_one_sentence():
    with pytest.raises(DownstreamUnavailable, match=r"the fine-tune training data of mmlu .* cannot be read: .*"
                                                    r"run once with hub access to cache it"):
        task_finetune.extra_training_docs("mmlu", {"path": "no-such-org/no-such-dataset", "split": "train"})
