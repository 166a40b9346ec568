"""`experiment=paper_gpt2` as shipped (batch 128 in micro-batches of 16, one pass over the prepared data,
the paper's 11 cells), offline at tiny scale: a tiny random GPT-2 and a local JSONL standing in for
Wikipedia and GPT-2, `dofla-prepare`, then the whole grid through the real CLI."""
from __future__ import annotations

import json
import random

from dofla.cli import prepare_main
from tests.config.test_configs import PAPER
from tests.integration.test_paper_grid import _variant
from tests.integration.test_pipeline import run_cli

WORDS = "in the beginning god created heaven and earth light darkness water firmament said let there be".split()


def test_the_paper_gpt2_experiment_runs_its_grid_from_prepared_data(tmp_path):
    rng = random.Random(0)
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))})
                              + "\n" for _ in range(100)))
    tiny = ["experiment=paper_gpt2", "model=tiny_gpt2", "data=text_files", f"data.options.paths=[{corpus}]",
            "data.seq_len=32", "data.cache_tokens=1024", "data.heldout_tokens=256", "allocation.num_samples=64",
            "eval.tasks=[]", f"cache_dir={tmp_path / 'cache'}"]
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
    for name, run in runs.items():
        config = json.loads((run / "run.json").read_text())["config"]
        # one pass over the prepared split, less the cached sample, in whole sequences
        assert config["data"]["num_tokens"] == (total - 1024) // 32 * 32
        assert (config["train"]["batch_size"], config["train"]["micro_batch_size"]) == (128, 16)
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["eval/student_ppl"] > 0
        if name != "performer":  # the baseline is not trained; every other cell saw the whole pass
            assert metrics["train/tokens"] >= (total - 1024) // (128 * 32) * 128 * 32
    assert len(list(csv_rows(sweep))) == 11
    # Algorithm 1's sample, drawn at random from the whole split, is the same for every cell: one cache
    caches = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name != "prepared"]  # activations
    assert len(caches) == 1, caches


def csv_rows(sweep):
    import csv

    with open(sweep / "report.csv") as f:
        yield from csv.DictReader(f)
