"""Through the CLI: a run with distillation and the fine-tune protocol prints its predicted time for every
stage, picks the task fine-tunes' micro-batch in the preflight, and its metrics.json holds each
stage's measured peak memory and step time beside the predictions."""
from __future__ import annotations

import json

from tests.conftest import write_local_tasks
from tests.integration.test_pipeline import run_cli


def test_metrics_hold_measured_peaks_and_step_times_beside_the_predictions(tmp_path):
    (tmp_path / "tasks").mkdir()
    tasks = write_local_tasks(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'cache'}",
                     "train.log_every=2", "distill=kl", "distill.tokens=1024", "distill.batch_size=2",
                     "distill.log_every=2",
                     "eval.protocol=finetune", "eval.tasks=[piqa_local]", f"eval.task_dirs=[{tasks}]",
                     "eval.finetune_lr_grid=[1e-3]", "eval.finetune_epochs=1", "eval.finetune_train_limit=8",
                     "eval.task_limit=4", "eval.finetune_micro_batch_size=auto", "eval.finetune_log_every=1",
                     timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dofla: predicted time on cpu" in out and "a sweep of n such cells" in out
    assert "eval.finetune_micro_batch_size=auto: piqa_local 4" in out  # the whole batch fits a CPU
    assert all(f"the {stage} stage grew the resident set by" in out or f"the {stage} stage peaked at" in out
               for stage in ("train", "distill"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for stage in ("train", "distill", "eval"):
        assert metrics[f"resources/{stage}/peak_rss_bytes"] > 0, stage
        assert metrics[f"resources/{stage}/predicted_bytes"] > 0, stage
        assert metrics[f"resources/{stage}/predicted_s"] > 0, stage
        assert metrics[f"resources/{stage}/step_s"] > 0, stage
    assert metrics["resources/eval_grid/predicted_s"] > 0
    assert metrics["resources/eval/step_s"] == metrics["finetuned/step_s"]
    assert "finetuned/student/piqa_local/acc" in metrics
    preflight = json.loads((run_dir / "preflight.json").read_text())
    assert preflight["eval"]["micro_batch"] == {"piqa_local": None}  # None: the whole batch of 4
