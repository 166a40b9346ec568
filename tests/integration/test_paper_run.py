"""`experiment=paper_gpt2` as shipped (batch 128 in the micro-batches the memory preflight picks, one pass over the prepared data,
the paper's 11 cells, the fine-tune protocol), offline at tiny scale: a tiny random GPT-2, a local JSONL
and two local lm-eval tasks standing in for GPT-2, Wikipedia and the seven tasks, `dofla-prepare`, then
the whole grid through the real CLI and its report."""
from __future__ import annotations

import json
import random

import pytest

from dofla.cli import prepare_main
from tests.config.test_configs import PAPER
from tests.conftest import activation_caches, write_local_tasks
from tests.integration.test_paper_grid import _variant
from tests.integration.test_pipeline import run_cli

WORDS = "in the beginning god created heaven and earth light darkness water firmament said let there be".split()


@pytest.mark.long
def test_the_paper_gpt2_experiment_runs_its_grid_from_prepared_data(tmp_path):
    rng = random.Random(0)
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))})
                              + "\n" for _ in range(100)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_local_tasks(tasks)  # two local lm-eval tasks stand in for the seven (the paper's LR grid, 1 epoch)
    tiny = ["experiment=paper_gpt2", "model=tiny_gpt2", "data=text_files", f"data.options.paths=[{corpus}]",
            "data.seq_len=32", "data.cache_tokens=1024", "data.heldout_tokens=256", "allocation.num_samples=64",
            "eval.tasks=[piqa_local,arc_local]", f"eval.task_dirs=[{tasks}]", "eval.task_limit=6",
            "eval.finetune_train_limit=8", "eval.finetune_epochs=1", f"paths.cache_dir={tmp_path / 'cache'}"]
    refused = run_cli(*tiny, f"hydra.run.dir={tmp_path / 'refused'}", "+variant=fix_softmax")
    assert refused.returncode == 2 and "dofla-prepare" in refused.stderr  # nothing prepared: one sentence
    prepare_main(tiny)
    sweep = tmp_path / "sweep"
    result = run_cli("-m", *tiny, f"hydra.sweep.dir={sweep}", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {_variant(p.parent): p.parent for p in sweep.rglob("metrics.json")}
    assert sorted(runs) == sorted(PAPER["paper_gpt2"]["cells"])
    prepared = next((tmp_path / "cache" / "prepared").iterdir())
    total = json.loads((prepared / "meta.json").read_text())["train"]["tokens"]
    first = {}
    for name, run in runs.items():
        config = json.loads((run / "run.json").read_text())["config"]
        # one pass over the prepared split, less the cached sample, in whole sequences
        assert config["data"]["num_tokens"] == (total - 1024) // 32 * 32
        assert (config["train"]["batch_size"], config["train"]["micro_batch_size"]) == (128, "auto")
        if name == "performer":  # random fixed features: nothing trains, no step to size (the task fine-tunes are)
            sized = json.loads((run / "preflight.json").read_text()) if (run / "preflight.json").exists() else {}
            assert "train" not in sized
        else:
            preflight = json.loads((run / "preflight.json").read_text())["train"]  # a tiny model: the whole batch fits
            assert preflight["micro_batch"] == preflight["fits"] == 128 and preflight["predicted"] < preflight["limit"]
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["eval/student_ppl"] > 0
        # the fine-tune protocol: the teacher's learning rates and scores are the same in every cell
        protocol = {k: v for k, v in metrics.items() if k.startswith(("finetuned/lr/", "finetuned/teacher/"))}
        assert len(protocol) == 2 + 3 and protocol == first.setdefault("protocol", protocol)
        assert 0 <= metrics["finetuned/student/avg_acc"] <= 1
        if name != "performer":  # the baseline is not trained; every other cell saw the whole pass
            assert metrics["train/tokens"] >= (total - 1024) // (128 * 32) * 128 * 32
    rows = list(csv_rows(sweep))
    assert len(rows) == 11 and all(row["finetuned/student/avg_acc"] for row in rows)  # the report's column
    assert len(list((tmp_path / "cache" / "teacher_scores").glob("teacher_finetuned-*.json"))) == 1
    # Algorithm 1's sample, drawn at random from the whole split, is the same for every cell: one cache
    caches = activation_caches(tmp_path / "cache")
    assert len(caches) == 1, caches


def csv_rows(sweep):
    import csv

    with open(sweep / "report.csv") as f:
        yield from csv.DictReader(f)
