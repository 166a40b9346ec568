"""The eval stage: the registered measurements a run enables (perplexity, attention error, the probes,
MQAR, generation agreement: :mod:`dofla.eval.measures`) and the lm-eval tasks -> metrics.json, resumable.

Every measurement is kept in ``eval_measurements.json`` under the settings it was taken with (the
model's settings, the held-out tokens, the eval options that matter to it), its per-sequence values
in ``eval_sequences.json`` (:mod:`dofla.eval.store`). A re-run reuses a measurement only for the same
settings and recomputes exactly those whose settings changed; ``metrics.json`` is written from the
measurements the current settings ask for. The teacher's own measurements are shared by every run
with the same teacher and held-out tokens (``<cache>/teacher_scores``).
"""
from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from dofla import distributed
from dofla.config import LEGACY_VALUES, RunConfig
from dofla.eval import suite
from dofla.eval.measures import EvalRun, take
from dofla.eval.store import MEASUREMENTS, Measurements, model_settings, tokens_digest  # noqa: F401 - API
from dofla.faults import kill_point
from dofla.record import write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import teacher_settings
from dofla.stages.results import Evaluation
from dofla.stages.sources import cache_root, data_source, open_data


def run(ctx: RunContext, student, data: RunData, tasks=None) -> Evaluation:
    """Teacher and student measured on the held-out data and the planned tasks -> metrics.json."""
    return Evaluation(evaluate(ctx.cfg, ctx.teacher, student, data.heldout_tokens, ctx.out_dir, ctx.tokenizer, tasks,
                               teacher_scores=cache_root(ctx.cfg) / "teacher_scores", source=data_source(ctx)))


def evaluate(cfg: RunConfig, teacher, student, heldout_tokens, out_dir: Path,
               tokenizer=None, plan=None, teacher_scores: Path | None = None, source=None) -> dict:
    """The registered measurements ``cfg.eval`` enables (:mod:`dofla.eval.measures`, in their fixed order)
    and the lm-eval tasks (``plan``, from :func:`dofla.eval.suite.plan_tasks`) -> metrics.json.
    ``teacher_scores``: a directory where the teacher's task scores are kept across runs (every run
    of a sweep has the same teacher; it is scored once). ``source``: the opened data the long held-out
    set is read from (default: opened from ``cfg``).

    Each measurement is saved as it completes, keyed by its settings, so a killed eval resumes and
    a changed setting redoes only what it affects. Under torchrun, the measurements marked
    ``every_rank`` (perplexity, attention error) are shared across the ranks; the tasks, the other
    measurements and every file are rank 0's.
    """
    main = distributed.is_main()
    store = Measurements(out_dir / MEASUREMENTS, main, shared=teacher_scores)
    who_settings = {"teacher": teacher_settings(cfg), "student": model_settings(student)}
    run = EvalRun(cfg, teacher, student, who_settings, heldout_tokens, tokenizer,
                  lambda: source if source is not None else open_data(cfg)[1])
    metrics = take(run, store, every_rank=True)
    if not main:  # the rest is rank 0's (lm-eval runs its own way; the probes are small)
        return metrics
    models = (("teacher", teacher), ("student", student))
    if plan is not None and plan.runnable:
        metrics.update(_task_measurements(cfg, models, who_settings, tokenizer, plan, store, teacher_scores))
    if plan is not None:
        write_json(out_dir / "tasks_skipped.json", plan.skipped)
    run.metrics = metrics  # what the later measurements read (the ablation: the full student's)
    metrics.update(take(run, store, every_rank=False))
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _task_measurements(cfg: RunConfig, models, who_settings: dict, tokenizer, plan, store,
                       teacher_scores: Path | None) -> dict:
    """lm-eval zero-shot scores per model and the fine-tune protocol, keyed by the task settings."""
    ev = cfg.eval
    tasks = {"tasks": plan.runnable, "limit": ev.task_limit, "batch_size": ev.task_batch_size,
             "task_dirs": list(plan.task_dirs), "lm_eval": version("lm_eval")}
    metrics = {}
    for who, model in models:
        def zero_shot(who=who, model=model) -> dict:
            kill_point(f"eval:tasks:{who}")
            if who == "teacher" and teacher_scores is not None:
                return suite.cached_teacher_scores(teacher_scores, model, tokenizer, plan, cfg)
            return suite.zero_shot(model, tokenizer, who, plan, ev)

        metrics.update(store.get(f"tasks/{who}", {"model": who_settings[who], **tasks}, zero_shot, plan))
    if ev.protocol == "finetune":
        (_, teacher), (_, student) = models
        settings = {**tasks, "teacher": who_settings["teacher"], "student": who_settings["student"],
                    "lr_grid": ev.finetune_lr_grid, "epochs": ev.finetune_epochs,
                    "train_limit": ev.finetune_train_limit, "seed": cfg.seed}
        # added later: in the key only when not the value every earlier measurement used
        settings.update({name.removeprefix("finetune_"): getattr(ev, name)
                         for name in ("finetune_batch_size", "finetune_max_length", "finetune_train_data")
                         if getattr(ev, name) != LEGACY_VALUES[("eval", name)]})
        if cfg.precision != LEGACY_VALUES[("run", "precision")]:  # the fine-tunes train under it
            settings["precision"] = cfg.precision
        metrics.update(store.get("finetuned", settings, lambda: suite.finetune_protocol(
            teacher, student, tokenizer, plan, cfg, teacher_scores, store.path.parent / "finetune_trials",
            who_settings["student"]), plan))
    if "tasks/teacher/avg_acc" in metrics and "tasks/student/avg_acc" in metrics:
        # what the distillation lost
        metrics["tasks/acc_gap"] = metrics["tasks/teacher/avg_acc"] - metrics["tasks/student/avg_acc"]
    return metrics
