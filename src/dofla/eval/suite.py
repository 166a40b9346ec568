"""The eval stage's task part: which lm-eval tasks can run (decided before any model loads),
zero-shot scores of teacher and student, the paper's fine-tune protocol, and the MQAR probe.

Metric names: ``tasks/<who>/<task>/<metric>`` (every numeric metric lm-eval reports: ``acc``,
``acc_norm``, ``contains``, RULER's per-length ``1024``, ...), ``tasks/<who>/avg_acc`` (who = teacher |
student), ``finetuned/<who>/<task>/acc`` and ``finetuned/lr/<task>`` for the protocol,
``mqar/<who>/T<len>`` for recall. Skipped tasks go to ``tasks_skipped.json`` with their reason
(keyed ``finetune/<task>`` when only the protocol skipped it).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from dofla.errors import DoflaError
from dofla.eval.config import EvalConfig
from dofla.eval.downstream import DOWNSTREAM7, availability, dataset_specs, evaluate_tasks, manager_for
from dofla.eval.finetune_store import TrialStore
from dofla.eval.mmlu_dev import MMLU_DEV_TASK, write_mmlu_dev_task
from dofla.eval.mqar import mqar_curve
from dofla.eval.task_finetune import FinetuneProtocolConfig, TeacherProtocol, run_finetune_protocol, run_teacher_protocol
from dofla.models.loading import weights_fields
from dofla.record import read_json, write_json

logger = logging.getLogger(__name__)

# lm-eval's recall tasks: RULER's single-needle retrieval (synthetic, at the lengths the model reaches)
# and the in-context extraction tasks the gated delta-rule papers report (hub data, skipped without it)
RECALL_SUITE = ("niah_single_1", "niah_single_2", "niah_single_3", "swde", "fda", "squad_completion")
# `eval.tasks=[downstream7]` stands for the paper's seven tasks, `eval.tasks=[recall_suite]` for the above.
ALIASES = {"downstream7": DOWNSTREAM7, "recall_suite": RECALL_SUITE}


class TaskPlanError(DoflaError, ValueError):
    """The requested tasks cannot give anything here (unknown names, or no data for any)."""


@dataclass
class TaskPlan:
    runnable: list[str]
    skipped: dict[str, str] = field(default_factory=dict)  # task -> one-sentence reason
    task_dirs: tuple[str, ...] = ()
    hub_reachable: bool = False


def expand_tasks(names: list[str]) -> list[str]:
    """Task names with aliases expanded, duplicates dropped, order kept."""
    out = [t for name in names for t in ALIASES.get(name, (name,))]
    return list(dict.fromkeys(out))


def plan_tasks(ev: EvalConfig, out_dir: Path, others_requested: bool) -> TaskPlan:
    """Build local tasks, check every task's data without loading it, print one line per skip.

    Raises :class:`TaskPlanError` for an unknown task name, or when no task can run and the run
    was asked for nothing else (``others_requested`` false).
    """
    tasks = expand_tasks(list(ev.tasks))
    dirs = [str(Path(d).expanduser().resolve()) for d in ev.task_dirs]
    if MMLU_DEV_TASK in tasks:
        local = out_dir / "lm_eval_tasks"
        write_mmlu_dev_task(local)
        dirs.append(str(local.resolve()))
    dirs_t = tuple(dirs)
    unknown = []
    for task in tasks:
        try:
            dataset_specs(manager_for(task, dirs_t), task)
        except KeyError:
            unknown.append(task)
    if unknown:
        raise TaskPlanError(f"eval.tasks has unknown lm-eval task(s) {unknown}; use lm-eval task names "
                            f"(e.g. {', '.join(ALIASES['downstream7'])}, {MMLU_DEV_TASK}) or add "
                            "their YAML folder to eval.task_dirs")
    runnable, skipped, reachable = availability(tasks, dirs_t)
    for reason in skipped.values():
        logger.warning(reason)
    if not runnable and not others_requested:
        raise TaskPlanError(f"none of eval.tasks {tasks} can run here (the lines above say why for each) "
                            "and nothing else was asked for; run once with network access, or use "
                            "eval.tasks=[mmlu_dev_offline], which needs no download")
    return TaskPlan(runnable, skipped, dirs_t, reachable)


def zero_shot(model, tokenizer, who: str, plan: TaskPlan, ev: EvalConfig) -> dict[str, float]:
    """``tasks/<who>/...`` metrics of one model on the plan's runnable tasks."""
    result = evaluate_tasks(model, tokenizer, plan.runnable, limit=ev.task_limit,
                            batch_size=ev.task_batch_size, task_dirs=list(plan.task_dirs),
                            hub_reachable=plan.hub_reachable)
    plan.skipped.update(result.skipped)
    return {f"tasks/{who}/{key.removeprefix('downstream/')}": value for key, value in result.metrics.items()}


def teacher_file(directory: Path, plan: TaskPlan, cfg, kind: str, extra: dict | None = None) -> Path:
    """``directory/<kind>-<digest>.json``: where a teacher measurement of the plan's tasks is kept,
    keyed by (model, tasks, task files, limit, lm-eval version, ``extra``)."""
    files = sorted(p for d in plan.task_dirs for p in Path(d).rglob("*") if p.is_file())
    digest = hashlib.sha256(json.dumps({
        "model": cfg.model.source, "revision": cfg.model.revision, "seed": cfg.seed,
        "tiny_layers": cfg.model.tiny_layers, "tasks": plan.runnable, **weights_fields(cfg.model.source),
        "limit": cfg.eval.task_limit, "lm_eval": version("lm_eval"),
        # a task YAML names its data by absolute path, which differs per run: hash without it
        "files": [[p.name, hashlib.sha256(p.read_bytes().replace(str(p.parent).encode(), b"")).hexdigest()]
                  for p in files],
        **({"extra": extra} if extra else {}),
    }, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"{kind}-{digest}.json"


def kept(path: Path | None, compute, what: str):
    """The JSON at ``path`` when it exists, else ``compute()`` written there (None: never kept)."""
    value = read_json(path) if path is not None else None
    if value is None:
        value = compute()
        if path is not None:
            write_json(path, value)
    else:
        logger.info(f"dofla: {what} reused from {path}")
    return value


def cached_teacher_scores(directory: Path, teacher, tokenizer, plan: TaskPlan, cfg) -> dict[str, float]:
    """The teacher's ``tasks/teacher/...`` scores, computed once per (model, tasks, task files,
    limit, lm-eval version) and kept in ``directory``; later runs with the same teacher read them."""
    return kept(teacher_file(directory, plan, cfg, "teacher_tasks"),
                lambda: zero_shot(teacher, tokenizer, "teacher", plan, cfg.eval), "teacher task scores")


def finetune_batch_sizes(ev: EvalConfig) -> dict:
    """``eval.finetune_batch_size`` as {task: sequences per step, "default": for the other tasks}."""
    sizes = ev.finetune_batch_size
    return {"default": EvalConfig.finetune_batch_size, **sizes} if isinstance(sizes, dict) else {"default": sizes}


def finetune_micro_batch_sizes(ev: EvalConfig) -> dict:
    """``eval.finetune_micro_batch_size`` as {task: sequences per forward, "default": ...} (None: the
    whole batch; ``auto`` stays ``auto`` until the memory preflight resolves it)."""
    sizes = ev.finetune_micro_batch_size
    return {"default": None, **sizes} if isinstance(sizes, dict) else {"default": sizes}


def protocol_config(plan: TaskPlan, ev: EvalConfig, seed: int, precision: str = "fp32"):
    """The fine-tune protocol's settings from ``eval`` (dofla.eval.task_finetune); a micro-batch still
    ``auto`` (no memory preflight ran, e.g. ``dofla-eval``) is the whole batch, said once."""
    sizes, micro = finetune_batch_sizes(ev), finetune_micro_batch_sizes(ev)
    if "auto" in micro.values():
        logger.warning("dofla: eval.finetune_micro_batch_size=auto needs the memory preflight of a dofla run; "
              "fine-tuning whole batches here")
        micro = {task: None if m == "auto" else m for task, m in micro.items()}
    default, micro_default = sizes.pop("default"), micro.pop("default")
    return FinetuneProtocolConfig(lr_grid=tuple(ev.finetune_lr_grid), epochs=ev.finetune_epochs,
                                  batch_size=default, task_batch_sizes=tuple(sorted(sizes.items())),
                                  max_length=ev.finetune_max_length,
                                  train_limit=ev.finetune_train_limit, eval_limit=ev.task_limit,
                                  eval_batch_size=ev.task_batch_size, seed=seed, task_dirs=plan.task_dirs,
                                  train_data={task: dict(spec) for task, spec in (ev.finetune_train_data or {}).items()},
                                  micro_batch_size=micro_default, task_micro_batch_sizes=tuple(sorted(micro.items())),
                                  precision=precision, log_every=ev.finetune_log_every,
                                  checkpoint_every=ev.finetune_checkpoint_every)


# how the protocol runs, not what it computes: out of the teacher grid's key
UNKEYED = ("task_dirs", "eval_batch_size", "micro_batch_size", "task_micro_batch_sizes", "log_every",
           "checkpoint_every")


def protocol_settings(pcfg) -> dict:
    """What the fine-tune protocol's results depend on; settings added later are in it only when set
    away from the value every earlier result used (older kept grids stay valid)."""
    return {k: v for k, v in asdict(pcfg).items() if k not in UNKEYED
            and not (k == "train_data" and not v) and not (k == "precision" and v == "fp32")}


def finetune_protocol(teacher, student, tokenizer, plan: TaskPlan, cfg, directory: Path | None = None,
                      trials_dir: Path | None = None, student_settings: dict | None = None) -> dict[str, float]:
    """The paper's protocol on the plan's tasks: learning rate picked on the teacher, reused.

    The teacher's half (its grid search) is kept in ``directory`` and computed once per teacher and
    protocol settings: the cells of a sweep share it trial by trial (each (task, learning rate) runs in
    one process, under a file lock; the others wait for it or reuse it), and a killed job resumes each
    trial from its checkpoint. ``trials_dir`` (with ``student_settings``, what identifies the student)
    keeps the student's trials the same way. Returns the ``finetuned/...`` metrics, with
    ``finetuned/step_s``: the measured seconds per fine-tune step over the trials that report it.
    """
    pcfg = protocol_config(plan, cfg.eval, cfg.seed, cfg.precision)
    settings = protocol_settings(pcfg)
    path = None if directory is None else teacher_file(directory, plan, cfg, "teacher_finetuned", settings)
    grid = None if path is None else TrialStore(path.with_suffix(""), {"grid": path.stem}, pcfg.checkpoint_every)
    teacher_half = TeacherProtocol.from_json(kept(
        path, lambda: run_teacher_protocol(teacher, tokenizer, plan.runnable, pcfg, store=grid).to_json(),
        "the teacher's fine-tune protocol (learning rates and scores)"))
    stores = {}
    if trials_dir is not None and student_settings is not None:
        stores["student"] = TrialStore(trials_dir, {"student": student_settings, "protocol": settings},
                                       pcfg.checkpoint_every)
    result = run_finetune_protocol(teacher, {"student": student}, tokenizer, plan.runnable, pcfg, teacher_half, stores)
    plan.skipped.update({f"finetune/{task}": why for task, why in result.skipped.items()})
    timed = [s for trials in [*teacher_half.grid.values(), result.scores["student"].values()] for s in trials if s.steps]
    steps = {"finetuned/step_s": sum(s.seconds for s in timed) / sum(s.steps for s in timed)} if timed else {}
    return {**result.flat(), **steps}


def mqar(model, who: str, ev: EvalConfig, seed: int) -> dict:
    """``mqar/<who>/T<len>``: recall accuracy at each length (lengths past the context are dropped), and
    each example's share under ``seq/`` (an interval over the examples; the same examples for every
    model of a seed)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    curve = mqar_curve(model, vocab, tuple(ev.mqar_seq_lens), ev.mqar_examples, seed)
    return {**{f"mqar/{who}/T{length}": hits.mean().item() for length, hits in curve.items()},
            **{f"seq/mqar/{who}/T{length}": hits.tolist() for length, hits in curve.items()}}
