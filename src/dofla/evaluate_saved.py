"""``dofla-eval DIR [overrides]``: the project's evaluation of a saved model, without the pipeline.

DIR is a saved dofla student (either config form) or any Hugging Face causal-LM directory with a
tokenizer. The overrides are the pipeline's (``eval=recall``, ``eval.tasks=[piqa]``,
``data=wikitext103``, ...): ``data`` gives the held-out text, ``eval`` what to measure:

- held-out loss and perplexity (``eval.perplexity``), ``eval/model_loss``, ``eval/model_ppl``;
- loss by position (``eval.position_buckets``), passkey (``eval.passkey_lengths``);
- lm-eval tasks (``eval.tasks``), MQAR (``eval.mqar``).

Results go to ``OUT/metrics.json`` (``--out``, default ``outputs/eval/<date>/<time>``); each
measurement is kept in ``OUT/eval_measurements.json`` under its settings, so a killed or repeated
evaluation redoes only what changed. The metric names say ``model`` where a run says ``student``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from dofla.config import RunConfig
from dofla.errors import DoflaError
from dofla.eval import probes, suite
from dofla.eval.metrics import heldout_loss
from dofla.models.hub_export import load_student_tokenizer, teacher_config_dict
from dofla.models.loading import load_teacher
from dofla.models.student import load_student
from dofla.record import write_json
from dofla.stages.data import open_or_prepare, pack_heldout
from dofla.stages.eval import MEASUREMENTS, Measurements, model_settings, tokens_digest

WHO = "model"


class SavedModelError(DoflaError, ValueError):
    """DIR cannot be evaluated (no model, no tokenizer)."""


def load_saved(directory: str | Path):
    """(model in eval mode, tokenizer) from a student or any Hugging Face model directory."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise SavedModelError(f"{directory} has no config.json; pass a directory written by save_pretrained "
                              "(a run's student/ or any Hugging Face model directory)")
    if teacher_config_dict(json.loads(config_path.read_text())).get("dofla") is None:
        return load_teacher(str(directory))
    try:
        tokenizer = load_student_tokenizer(directory)
    except (OSError, ValueError) as err:
        raise SavedModelError(f"{directory} has no usable tokenizer ({str(err).splitlines()[0]}); save the "
                              "teacher's tokenizer beside the model (tokenizer.save_pretrained(DIR))") from None
    return load_student(directory), tokenizer


def evaluate_saved(directory: str | Path, cfg: RunConfig, out_dir: str | Path) -> dict:
    """Every measurement ``cfg.eval`` asks for on the model in ``directory`` -> ``out_dir/metrics.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, source = open_or_prepare(cfg)  # checks the data (prepared tokens, prepared now where the corpus prepares itself) before the model loads
    plan = suite.plan_tasks(cfg.eval, out_dir, others_requested=True) if cfg.eval.tasks else None
    model, tokenizer = load_saved(directory)
    store, ev, settings = Measurements(out_dir / MEASUREMENTS, True), cfg.eval, model_settings(model)
    metrics: dict = {}
    if ev.perplexity:
        heldout = pack_heldout(cfg, tokenizer, source)

        def perplexity() -> dict:
            loss = heldout_loss(model, heldout, ev.batch_size)
            return {f"eval/{WHO}_loss": loss, f"eval/{WHO}_ppl": math.exp(loss) if loss < 700 else float("inf")}

        metrics.update(store.get("perplexity", {"model": settings, "heldout": tokens_digest(heldout),
                                                "batch_size": ev.batch_size}, perplexity))
    if ev.position_buckets:
        long = probes.long_tokens(cfg, tokenizer, source)
        metrics.update(store.get("position", {"model": settings, "tokens": tokens_digest(long),
                                              "edges": ev.position_buckets},
                                 lambda: probes.position_metrics(cfg, WHO, model, long)))
    if ev.passkey_lengths:
        metrics.update(store.get("passkey", probes.passkey_settings(cfg, settings),
                                 lambda: probes.passkey_metrics(cfg, WHO, model, tokenizer)))
    if plan is not None and plan.runnable:
        task_settings = {"model": settings, "tasks": plan.runnable, "limit": ev.task_limit,
                         "task_dirs": list(plan.task_dirs)}
        metrics.update(store.get("tasks", task_settings, lambda: suite.zero_shot(model, tokenizer, WHO, plan, ev),
                                 plan))
        write_json(out_dir / "tasks_skipped.json", plan.skipped)
    if ev.mqar:
        metrics.update(store.get("mqar", {"model": settings, "seq_lens": ev.mqar_seq_lens,
                                          "examples": ev.mqar_examples, "seed": cfg.seed},
                                 lambda: suite.mqar(model, WHO, ev, cfg.seed)))
    metrics["model/path"] = str(Path(directory).resolve())
    write_json(out_dir / "metrics.json", metrics)
    return metrics
