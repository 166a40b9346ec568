"""The eval stage: perplexity, attention error, lm-eval tasks, probes and MQAR -> metrics.json, resumable.

Every measurement is kept in ``eval_measurements.json`` under the settings it was taken with (the
model's settings, the held-out tokens, the eval options that matter to it), its per-sequence values
in ``eval_sequences.json`` (:mod:`dofla.eval.store`). A re-run reuses a measurement only for the same
settings and recomputes exactly those whose settings changed; ``metrics.json`` is written from the
measurements the current settings ask for. The teacher's own measurements are shared by every run
with the same teacher and held-out tokens (``<cache>/teacher_scores``).
"""
from __future__ import annotations

import hashlib
import json
import math
from importlib.metadata import version
from pathlib import Path

import torch

from dofla import distributed
from dofla.config import LEGACY_VALUES, RunConfig
from dofla.eval import probes, suite
from dofla.eval.memory import memory_metrics
from dofla.eval.metrics import attention_errors, heldout_losses
from dofla.eval.store import MEASUREMENTS, Measurements
from dofla.faults import kill_point
from dofla.record import write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import teacher_settings
from dofla.stages.results import Evaluation
from dofla.stages.sources import cache_root, data_source, open_data

def model_settings(model) -> dict:
    """The settings a model was built from (``dofla_settings``, attached by the assemble and
    fine-tune stages), else a fingerprint of its weights (a model handed in from Python)."""
    settings = getattr(model, "dofla_settings", None)
    if settings is not None:
        return {"settings": settings}
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):  # raw bytes: any dtype, bf16 included
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"weights": digest.hexdigest()}


def tokens_digest(tokens) -> str:
    """SHA-256 of a (S, L) token tensor, shape included."""
    return hashlib.sha256(json.dumps(list(tokens.shape)).encode() + tokens.cpu().numpy().tobytes()).hexdigest()


def run(ctx: RunContext, student, data: RunData, tasks=None) -> Evaluation:
    """Teacher and student measured on the held-out data and the planned tasks -> metrics.json."""
    return Evaluation(evaluate(ctx.cfg, ctx.teacher, student, data.heldout_tokens, ctx.out_dir, ctx.tokenizer, tasks,
                               teacher_scores=cache_root(ctx.cfg) / "teacher_scores", source=data_source(ctx)))


def evaluate(cfg: RunConfig, teacher, student, heldout_tokens, out_dir: Path,
               tokenizer=None, plan=None, teacher_scores: Path | None = None, source=None) -> dict:
    """Held-out perplexity, per-layer attention error, lm-eval tasks (``plan``, from
    :func:`dofla.eval.suite.plan_tasks`) and MQAR for teacher and student -> metrics.json.
    ``teacher_scores``: a directory where the teacher's task scores are kept across runs (every run
    of a sweep has the same teacher; it is scored once). ``source``: the opened data the long held-out
    set is read from (default: opened from ``cfg``).

    Each measurement is saved as it completes, keyed by its settings, so a killed eval resumes and
    a changed setting redoes only what it affects. Under torchrun, perplexity and attention error
    are shared across the ranks; the tasks, MQAR and every file are rank 0's.
    """
    main = distributed.is_main()
    store = Measurements(out_dir / MEASUREMENTS, main, shared=teacher_scores)
    who_settings = {"teacher": teacher_settings(cfg), "student": model_settings(student)}
    models = (("teacher", teacher), ("student", student))
    metrics = _shared_measurements(cfg, models, who_settings, heldout_tokens, store)
    if not main:  # the rest is rank 0's (lm-eval runs its own way; MQAR is small)
        return metrics
    if plan is not None and plan.runnable:
        metrics.update(_task_measurements(cfg, models, who_settings, tokenizer, plan, store, teacher_scores))
    if plan is not None:
        write_json(out_dir / "tasks_skipped.json", plan.skipped)
    metrics.update(_probe_measurements(cfg, models, who_settings, heldout_tokens, tokenizer, store, metrics, source))
    if cfg.eval.mqar:
        for who, model in models:
            settings = {"model": who_settings[who], "seq_lens": cfg.eval.mqar_seq_lens,
                        "examples": cfg.eval.mqar_examples, "seed": cfg.seed}
            metrics.update(store.get(f"mqar/{who}", settings, lambda: suite.mqar(model, who, cfg.eval, cfg.seed)))
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def _shared_measurements(cfg: RunConfig, models, who_settings: dict, heldout_tokens, store) -> dict:
    """Perplexity and attention error (every rank takes part under torchrun)."""
    metrics = {}
    if cfg.eval.perplexity:
        for who, model in models:
            def perplexity(who=who, model=model) -> dict:
                kill_point(f"eval:{who}")
                losses = heldout_losses(model, heldout_tokens, cfg.eval.batch_size, data_parallel=True)
                loss = losses.mean().item()
                return {f"eval/{who}_loss": loss, f"eval/{who}_ppl": math.exp(loss) if loss < 700 else float("inf"),
                        f"seq/heldout/{who}": losses.tolist()}

            settings = {"model": who_settings[who], "heldout": tokens_digest(heldout_tokens),
                        "batch_size": cfg.eval.batch_size}
            metrics.update(store.get(f"perplexity/{who}", settings, perplexity, share=who == "teacher"))
        metrics["eval/ppl_ratio"] = metrics["eval/student_ppl"] / metrics["eval/teacher_ppl"]
    if cfg.eval.attention_error:
        (_, teacher), (_, student) = models
        tokens = heldout_tokens[: cfg.eval.attn_error_seqs]

        def attention() -> dict:
            kill_point("eval:attention")
            errors = attention_errors(teacher, student, tokens, data_parallel=True)
            out = {f"eval/attn_error/layer_{i:02d}": float(err) for i, err in enumerate(errors)}
            return {**out, "eval/attn_error/mean": float(sum(errors) / len(errors))}

        settings = {"teacher": who_settings["teacher"], "student": who_settings["student"],
                    "tokens": tokens_digest(tokens)}
        metrics.update(store.get("attention", settings, attention))
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


def _probe_measurements(cfg: RunConfig, models, who_settings: dict, heldout_tokens, tokenizer, store,
                        full: dict, source=None) -> dict:
    """The optional probes of :mod:`dofla.eval.probes` (rank 0), each keyed by its settings."""
    ev, metrics = cfg.eval, {}
    (_, teacher), (_, student) = models
    held = {"heldout": tokens_digest(heldout_tokens), "batch_size": ev.batch_size,
            "attn_error_seqs": ev.attn_error_seqs}
    if ev.ablate_linear:
        settings = {"student": who_settings["student"], "teacher": who_settings["teacher"], **held,
                    "perplexity": ev.perplexity, "attention_error": ev.attention_error}
        metrics.update(store.get("ablate_linear", settings,
                                 lambda: probes.ablation_metrics(cfg, teacher, student, heldout_tokens, full)))
    if ev.window_mass and cfg.attention.window > 0:
        settings = {"teacher": who_settings["teacher"], **held, "window": cfg.attention.window,
                    "sinks": cfg.attention.sinks}
        metrics.update(store.get("window_mass", settings,
                                 lambda: probes.window_mass_metrics(cfg, teacher, heldout_tokens)))
    long = None
    for who, model in models:
        if ev.memory_contexts:
            metrics.update(store.get(f"memory/{who}", {"model": who_settings[who], "contexts": ev.memory_contexts},
                                     lambda who=who, model=model: memory_metrics(who, model, ev.memory_contexts),
                                     share=who == "teacher"))
        if ev.position_buckets:
            long = long if long is not None else probes.long_tokens(cfg, tokenizer, source or open_data(cfg)[1])
            settings = {"model": who_settings[who], "tokens": tokens_digest(long), "edges": ev.position_buckets}
            metrics.update(store.get(f"position/{who}", settings,
                                     lambda who=who, model=model: probes.position_metrics(cfg, who, model, long),
                                     share=who == "teacher"))
        if ev.passkey_lengths:
            metrics.update(store.get(f"passkey/{who}", probes.passkey_settings(cfg, who_settings[who]),
                                     lambda who=who, model=model: probes.passkey_metrics(cfg, who, model,
                                                                                          tokenizer),
                                     share=who == "teacher"))
    return metrics
