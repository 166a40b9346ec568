"""Downstream evaluation on tiny local lm-eval tasks (piqa/arc schemas), offline skips, MQAR."""
from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import yaml

from dofla.eval.downstream import DOWNSTREAM7, DownstreamUnavailable, availability, evaluate_tasks, row_metrics
from dofla.eval.mmlu_dev import mmlu_dev_questions, write_mmlu_dev_task
from dofla.eval.mqar import id_ranges, make_mqar_batch, mqar_accuracy, mqar_curve, mqar_hits
from dofla.eval.task_finetune import FinetuneProtocolConfig, pad_batch, run_finetune_protocol
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from tests.conftest import ACC_METRICS, SCHEMAS, write_local_tasks



@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_local_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def teacher_student():
    teacher = build_tiny_model("gpt2", seed=0)
    return teacher, convert(copy.deepcopy(teacher), feature_map="learned_prf")


def assert_unit_interval(metrics: dict) -> None:
    assert metrics and all(0.0 <= v <= 1.0 for v in metrics.values()), metrics


def test_local_tasks_run_on_teacher_and_student(task_dir, teacher_student, byte_tokenizer):
    for model in teacher_student:
        result = evaluate_tasks(model, byte_tokenizer, ["piqa_local", "arc_local"], limit=8,
                                task_dirs=[task_dir])
        assert result.ran == ["piqa_local", "arc_local"] and not result.skipped
        for task in result.ran:
            assert {f"downstream/{task}/acc", f"downstream/{task}/acc_norm"} <= set(result.metrics)
        assert result.metrics["downstream/piqa_local/version"] == 2.0  # the task's metadata, as lm-eval reports it
        assert_unit_interval({k: v for k, v in result.metrics.items() if not k.endswith("/version")})
        expected = (result.acc("piqa_local") + result.acc("arc_local")) / 2
        assert result.metrics["downstream/avg_acc"] == pytest.approx(expected)


@pytest.mark.long  # the seven real tasks probed offline (half a minute); the local tasks run by default
def test_real_tasks_offline_are_skipped_in_one_sentence(task_dir, teacher_student, byte_tokenizer,
                                                        monkeypatch, tmp_path, capsys):
    # An empty cache and offline mode make the outcome the same on any machine, network or not.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    teacher = teacher_student[0]
    start = time.monotonic()
    result = evaluate_tasks(teacher, byte_tokenizer, [*DOWNSTREAM7, "piqa_local"], limit=4,
                            task_dirs=[task_dir])
    with pytest.raises(DownstreamUnavailable):
        evaluate_tasks(teacher, byte_tokenizer, list(DOWNSTREAM7), limit=4)
    # no network waits: one hub timeout per task would take minutes; the bound leaves room for a
    # busy machine (it ran 60 s+ beside two training runs on 2 cores)
    assert time.monotonic() - start < 180
    assert result.ran == ["piqa_local"] and set(result.skipped) == set(DOWNSTREAM7)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("downstream task")]
    assert len(lines) == 2 * len(DOWNSTREAM7)
    assert all(ln.endswith("run once with network access to cache it") for ln in lines)
    assert "downstream task mmlu skipped: its dataset cais/mmlu (57 configs)" in "\n".join(lines)


def write_generation_task(root) -> str:
    """A local generate_until task scored by exact match under a regex filter (a GSM8K-style answer)."""
    docs = root / "gen.jsonl"
    docs.write_text("".join(json.dumps({"question": f"{i} plus one is", "answer": str(i + 1)}) + "\n" for i in range(4)))
    config = {"task": "gen_local", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(docs)}},
              "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{question}}",
              "doc_to_target": "{{answer}}", "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
              "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
              "filter_list": [{"name": "strict-match", "filter": [{"function": "regex", "regex_pattern": "(\\d+)"},
                                                                  {"function": "take_first"}]}]}
    (root / "gen_local.yaml").write_text(yaml.safe_dump(config))
    return "gen_local"


def test_generation_metrics_are_kept_beside_accuracy(tmp_path, task_dir, teacher_student, byte_tokenizer):
    task = write_generation_task(tmp_path)
    result = evaluate_tasks(teacher_student[0], byte_tokenizer, [task, "piqa_local"], limit=4,
                            task_dirs=[tmp_path, task_dir])
    assert result.ran == [task, "piqa_local"]
    assert set(result.metrics) == {f"downstream/{task}/exact_match,strict-match",
                                   "downstream/piqa_local/acc", "downstream/piqa_local/acc_norm",
                                   "downstream/piqa_local/version", "downstream/avg_acc"}
    assert 0.0 <= result.metrics[f"downstream/{task}/exact_match,strict-match"] <= 1.0
    assert result.metrics["downstream/avg_acc"] == result.acc("piqa_local")  # a task without acc is not averaged


def test_row_metrics_keep_numbers_and_name_filters():
    row = {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,flexible-extract": 1,
           "bleu,none": "N/A", "1024,none": 0.25, "sample_len": 8, "version": 2.0}
    assert row_metrics("t", row) == {"downstream/t/acc": 0.5, "downstream/t/exact_match,flexible-extract": 1.0,
                                     "downstream/t/1024": 0.25, "downstream/t/version": 2.0}


def write_synthetic_task(root, generator: str) -> str:
    """A local task that builds its documents in ``gen.py`` (as RULER's do), no dataset named."""
    (root / "gen.py").write_text(generator)
    (root / "synth_local.yaml").write_text(
        "task: synth_local\ndataset_path: ''\ncustom_dataset: !function gen.make\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs: {until: ['\\n'], max_gen_toks: 2}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n")
    return "synth_local"


def test_task_without_its_generator_package_is_one_sentence(tmp_path):
    task = write_synthetic_task(tmp_path, "import dofla_absent_package\n\ndef make(**kwargs):\n    return {}\n")
    runnable, skipped, _ = availability([task], (str(tmp_path),))
    assert runnable == [] and skipped[task].startswith(f"downstream task {task} skipped: its code needs a package")
    assert "No module named 'dofla_absent_package'" in skipped[task] and skipped[task].count(". ") == 0


@pytest.fixture
def offline_empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


@pytest.mark.slow  # lm-eval's whole task index and 500 generated documents per length: 1-2 min
def test_ruler_needle_task_runs_offline_at_the_lengths_asked(offline_empty_cache, byte_tokenizer):
    """lm-eval's own niah_single_1 builds its haystack from fixed sentences: no hub probe, no download;
    its documents are generated with the model's tokenizer at each length the model's context holds."""
    pytest.importorskip("wonderwords", reason="RULER's generators need wonderwords (lm-eval's ruler extra)")
    teacher = build_tiny_model("llama", seed=0)
    # RoPE: no learned positions. RULER's shortest prompt with five haystack sentences is ~900 bytes (one
    # token each here) plus 128 generated tokens: 1024 is the least length lm-eval 0.4.12 fills.
    teacher.config.max_position_embeddings = 1536
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf")
    assert availability(["niah_single_1", "niah_single_2"], ())[:2] == (["niah_single_1"], {
        "niah_single_2": "downstream task niah_single_2 skipped: its dataset baber/paul_graham_essays cannot "
                         "be downloaded (no network or hub access) and is not in the local HF cache; run once "
                         "with network access to cache it"})
    for model in (teacher, student):
        result = evaluate_tasks(model, byte_tokenizer, ["niah_single_1"], limit=2, batch_size=2,
                                seq_lengths=[1024, 1536, 2048])
        assert result.ran == ["niah_single_1"] and not result.skipped
        # one score per length that fits; RULER's -1 for its unused default length (4096) is not a score
        assert set(result.metrics) == {"downstream/niah_single_1/1024", "downstream/niah_single_1/1536",
                                       "downstream/niah_single_1/version"}
        assert all(0.0 <= result.metrics[f"downstream/niah_single_1/{n}"] <= 1.0 for n in (1024, 1536))
    short = evaluate_tasks(teacher, byte_tokenizer, ["niah_single_1"], limit=2, seq_lengths=[4096])
    assert short.ran == [] and short.skipped == {"niah_single_1": (
        "downstream task niah_single_1 skipped: none of its lengths [4096] fits the model's context of 1536 "
        "tokens; ask for shorter ones")}


def test_missing_local_data_file_is_skipped(tmp_path, teacher_student, byte_tokenizer):
    config = {"task": "gone_local", "dataset_path": "json", "output_type": "multiple_choice",
              "dataset_kwargs": {"data_files": {"validation": str(tmp_path / "absent.jsonl")}},
              "validation_split": "validation", "metric_list": ACC_METRICS, **SCHEMAS["piqa_local"]}
    (tmp_path / "gone.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(DownstreamUnavailable):
        evaluate_tasks(teacher_student[0], byte_tokenizer, ["gone_local"], task_dirs=[tmp_path])


def test_offline_mmlu_dev_task_builds_and_runs(tmp_path, teacher_student, byte_tokenizer):
    docs, unparsed = mmlu_dev_questions()
    assert len(docs) >= 250 and unparsed <= 5
    assert all(len(d["choices"]) == 4 and 0 <= d["answer"] < 4 for d in docs)
    name = write_mmlu_dev_task(tmp_path)
    result = evaluate_tasks(teacher_student[0], byte_tokenizer, [name], limit=10, task_dirs=[tmp_path])
    assert result.ran == [name]
    assert_unit_interval(result.metrics)


def test_pad_batch_labels_only_the_continuation():
    input_ids, labels = pad_batch([([1, 2, 3], [4, 5]), ([6], [7])], max_length=4)
    assert input_ids.tolist() == [[2, 3, 4, 5], [6, 7, 0, 0]]
    assert labels.tolist() == [[-100, -100, 4, 5], [-100, 7, -100, -100]]


def test_finetune_protocol_end_to_end(task_dir, teacher_student, byte_tokenizer):
    teacher, student = teacher_student
    before = [p.clone() for p in teacher.parameters()]
    cfg = FinetuneProtocolConfig(lr_grid=(1e-4, 1e-3), epochs=1, batch_size=4, train_limit=8,
                                 eval_limit=6, task_dirs=(str(task_dir),))
    result = run_finetune_protocol(teacher, {"fix": student}, byte_tokenizer, ["piqa_local"], cfg)
    assert set(result.scores) == {"teacher", "fix"} and result.lrs["piqa_local"] in cfg.lr_grid
    for name in ("teacher", "fix"):
        score = result.scores[name]["piqa_local"]
        assert len(score.epoch_accs) == 1 and score.chosen_epoch == 1 and 0 <= score.acc <= 1
    flat = result.flat()
    assert {"finetuned/teacher/avg_acc", "finetuned/fix/avg_acc", "finetuned/lr/piqa_local"} <= set(flat)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))  # copies trained


def test_mqar_batch_is_deterministic_and_well_formed():
    ids, positions, targets = make_mqar_batch(257, 64, num_pairs=10, num_queries=6, num_examples=3, seed=1)
    again = make_mqar_batch(257, 64, num_pairs=10, num_queries=6, num_examples=3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip((ids, positions, targets), again))
    keys, values, _ = id_ranges(257)
    assert ids.shape == (3, 64) and positions.shape == targets.shape == (3, 6)
    query_keys = ids.gather(1, positions)
    assert all(k in keys for k in query_keys.flatten().tolist())
    assert torch.equal(ids.gather(1, positions + 1), targets)
    assert all(t in values for t in targets.flatten().tolist())


def recall_oracle(input_ids: torch.Tensor) -> torch.Tensor:
    """Perfect recall: at every position, predict the token that followed the same token earlier."""
    logits = torch.zeros(*input_ids.shape, 257)
    for b, row in enumerate(input_ids.tolist()):
        seen = {}
        for t, tok in enumerate(row):
            if tok in seen:
                logits[b, t, seen[tok]] = 1.0
            if t + 1 < len(row) and tok not in seen:
                seen[tok] = row[t + 1]
    return logits


def test_mqar_oracle_recalls_and_random_model_is_at_chance(teacher_student):
    assert mqar_accuracy(recall_oracle, 257, 64, 12, 8, num_examples=4, seed=0) == 1.0
    num_values = len(id_ranges(257)[1])
    acc = mqar_accuracy(teacher_student[0], 257, 128, 32, 32, num_examples=8, seed=0)
    assert acc < 6 / num_values  # chance is 1/num_values ≈ 0.014; an untrained model cannot recall
    curve = mqar_curve(teacher_student[1], 257, seq_lens=(32, 64, 1024), num_examples=2)
    assert list(curve) == [32, 64] and all(v.shape == (2,) and ((0 <= v) & (v <= 1)).all() for v in curve.values())
    hits = mqar_hits(recall_oracle, 257, 64, 12, 8, num_examples=3, seed=0)
    assert hits.tolist() == [1.0, 1.0, 1.0]
