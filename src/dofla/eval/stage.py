"""The eval stage: perplexity, attention error, lm-eval tasks and MQAR -> metrics.json, resumable."""
from __future__ import annotations

from pathlib import Path

from dofla.config import RunConfig
from dofla.record import read_json, write_json


def eval_stage(cfg: RunConfig, teacher, student, heldout_tokens, out_dir: Path,
               tokenizer=None, plan=None, teacher_scores: Path | None = None) -> dict:
    """Held-out perplexity, per-layer attention error, lm-eval tasks (``plan``, from
    :func:`dofla.eval.suite.plan_tasks`) and MQAR for teacher and student -> metrics.json.
    ``teacher_scores``: a directory where the teacher's task scores are kept across runs (every run
    of a sweep has the same teacher; it is scored once).

    Each measurement is saved as it completes (metrics.partial.json), so a killed eval resumes.
    Under torchrun, perplexity and attention error are shared across the ranks; the tasks, MQAR
    and every file are rank 0's.
    """
    import math

    from dofla import distributed
    from dofla.eval import attention_errors, heldout_loss, suite
    from dofla.faults import kill_point

    main = distributed.is_main()
    metrics = distributed.broadcast(read_json(out_dir / "metrics.json") if main else None)
    if metrics is not None:
        return metrics
    partial_path = out_dir / "metrics.partial.json"
    metrics = distributed.broadcast((read_json(partial_path) or {}) if main else None)

    def save() -> None:
        if main:
            write_json(partial_path, metrics)

    models = (("teacher", teacher), ("student", student))
    if cfg.eval.perplexity:
        for who, model in models:
            if f"eval/{who}_loss" in metrics:
                continue
            kill_point(f"eval:{who}")
            loss = heldout_loss(model, heldout_tokens, cfg.eval.batch_size, data_parallel=True)
            metrics[f"eval/{who}_loss"] = loss
            metrics[f"eval/{who}_ppl"] = math.exp(loss) if loss < 700 else float("inf")
            save()
        metrics["eval/ppl_ratio"] = metrics["eval/student_ppl"] / metrics["eval/teacher_ppl"]
    if cfg.eval.attention_error and "eval/attn_error/mean" not in metrics:
        kill_point("eval:attention")
        errors = attention_errors(teacher, student, heldout_tokens[: cfg.eval.attn_error_seqs], data_parallel=True)
        for i, err in enumerate(errors):
            metrics[f"eval/attn_error/layer_{i:02d}"] = float(err)
        metrics["eval/attn_error/mean"] = float(sum(errors) / len(errors))
        save()
    if not main:  # the rest is rank 0's (lm-eval runs its own way; MQAR is small)
        return metrics
    if plan is not None and plan.runnable:
        for who, model in models:
            if not any(k.startswith(f"tasks/{who}/") for k in metrics):
                kill_point(f"eval:tasks:{who}")
                if who == "teacher" and teacher_scores is not None:
                    metrics.update(suite.cached_teacher_scores(teacher_scores, model, tokenizer, plan, cfg))
                else:
                    metrics.update(suite.zero_shot(model, tokenizer, who, plan, cfg.eval))
                write_json(partial_path, metrics)
        if cfg.eval.protocol == "finetune" and not any(k.startswith("finetuned/") for k in metrics):
            metrics.update(suite.finetune_protocol(teacher, student, tokenizer, plan, cfg.eval, cfg.seed))
            write_json(partial_path, metrics)
        _task_gap(metrics)
    if plan is not None:
        write_json(out_dir / "tasks_skipped.json", plan.skipped)
    if cfg.eval.mqar:
        for who, model in models:
            if not any(k.startswith(f"mqar/{who}/") for k in metrics):
                metrics.update(suite.mqar(model, who, cfg.eval, cfg.seed))
                write_json(partial_path, metrics)
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _task_gap(metrics: dict) -> None:
    """tasks/acc_gap: teacher minus student average accuracy (what the distillation lost)."""
    if "tasks/teacher/avg_acc" in metrics and "tasks/student/avg_acc" in metrics:
        metrics["tasks/acc_gap"] = metrics["tasks/teacher/avg_acc"] - metrics["tasks/student/avg_acc"]
