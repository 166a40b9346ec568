"""A process that runs the fine-tune protocol on tiny models (the resume and sharing tests start it,
kill it, and run two at once): ``python -m tests.component.finetune_worker ROOT RUN_NAME [overrides...]``.

ROOT holds the lm-eval tasks (``ROOT/tasks``, written by the test) and the shared cache
(``ROOT/cache``); the run keeps its student trials in ``ROOT/RUN_NAME`` and writes the metrics to
``ROOT/RUN_NAME/metrics.json``.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.eval import suite
from dofla.logs import setup_logging
from dofla.models import convert
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model

PROTOCOL = ["eval.protocol=finetune", "eval.tasks=[piqa_local]", "eval.finetune_lr_grid=[1e-4,1e-3]",
            "eval.finetune_epochs=1", "eval.finetune_batch_size=4", "eval.finetune_train_limit=12",
            "eval.task_limit=4", "eval.finetune_checkpoint_every=1", "eval.finetune_log_every=2"]


def main(root: Path, name: str, overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", *PROTOCOL, f"eval.task_dirs=[{root / 'tasks'}]", *overrides]))
    run = root / name
    plan = suite.plan_tasks(cfg.eval, run, others_requested=False)
    teacher = build_tiny_model("llama", seed=0)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf")
    metrics = suite.finetune_protocol(teacher, student, build_byte_tokenizer(), plan, cfg, root / "cache",
                                      run / "finetune_trials", {"student": "tiny llama, learned_prf"})
    (run / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))


if __name__ == "__main__":
    setup_logging()  # as a command: its dofla: lines on stdout, where the tests read them
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
