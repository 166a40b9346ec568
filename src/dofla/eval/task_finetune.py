"""The paper's downstream protocol: fine-tune a fresh copy of each model per task, then score it.

Per task (METHOD §5): the learning rate is picked on the teacher from ``lr_grid`` and reused for
every student; each model trains for ``epochs`` epochs on the task's training split and keeps its
best epoch by eval accuracy (``last_checkpoint_tasks``, e.g. MMLU: ``single_epoch_epochs`` epoch,
last checkpoint). Training examples are lm-eval's own (context, correct continuation) pairs,
tokenised by lm-eval, with next-token loss on the continuation only (:mod:`dofla.eval.task_data`).
A task lm-eval defines no training split for (MMLU) trains on ``train_data[task]`` instead (the
paper: MMLU's auxiliary_train); scoring is the same lm-eval multiple-choice run as
``evaluate_tasks``. Selecting the epoch on the eval split is the paper's (optimistic) choice,
applied identically to teacher and students.

Each step is :func:`dofla.eval.task_step.finetune_step`: the batch in micro-batches whose gradients add up to the whole
batch's, the forwards under the run's precision (fp32 master weights). The trials (a model, a task,
a learning rate) run through :mod:`dofla.eval.task_trial`, which checkpoints and resumes them.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dofla.eval.downstream import DownstreamUnavailable, availability
from dofla.eval.finetune_store import share
from dofla.eval.task_data import extra_training_docs, gold_text, pad_batch, training_pairs  # noqa: F401 - API
from dofla.eval.task_step import TaskScore, finetune_step, summed_loss, target_tokens  # noqa: F401 - API
from dofla.eval.task_trial import run_trial

logger = logging.getLogger(__name__)


@dataclass
class FinetuneProtocolConfig:
    lr_grid: tuple[float, ...] = (1e-5, 3e-5, 1e-4)
    epochs: int = 3
    last_checkpoint_tasks: tuple[str, ...] = ("mmlu",)
    single_epoch_epochs: int = 1
    batch_size: int = 4  # sequences per step; ``task_batch_sizes`` overrides it per task
    task_batch_sizes: tuple[tuple[str, int], ...] = ()
    max_length: int = 512
    train_limit: int | None = None  # first N training docs (None: all)
    eval_limit: int | None = None
    eval_batch_size: int = 1
    seed: int = 0
    task_dirs: tuple[str, ...] = ()  # lm-eval task YAML folders (kept as absolute paths)
    # task -> training data where lm-eval has no training split: {path, name, split} or {files: [...]}
    train_data: dict[str, dict] = field(default_factory=dict)
    # sequences per forward (None: the whole batch); ``task_micro_batch_sizes`` overrides it per task.
    # The same gradients either way: it bounds the memory, not what is learned
    micro_batch_size: int | None = None
    task_micro_batch_sizes: tuple[tuple[str, int | None], ...] = ()
    precision: str = "fp32"  # the forwards' arithmetic (dofla.precision); the weights stay fp32
    log_every: int = 20  # steps between the losses' trips to the host
    checkpoint_every: int = 0  # steps between checkpoints inside an epoch (0: at epoch ends only)

    def __post_init__(self):
        self.task_dirs = tuple(str(Path(d).resolve()) for d in self.task_dirs)

    def batch_for(self, task: str) -> int:
        return dict(self.task_batch_sizes).get(task, self.batch_size)

    def micro_for(self, task: str) -> int | None:
        return dict(self.task_micro_batch_sizes).get(task, self.micro_batch_size)


@dataclass
class TeacherProtocol:
    """The teacher's half of the protocol, the same for every student of that teacher: the learning
    rate picked per task, the teacher's scores at it and the tasks skipped (kept across runs as JSON)."""

    lrs: dict[str, float]
    scores: dict[str, TaskScore]
    skipped: dict[str, str]
    grid: dict[str, list[TaskScore]] = field(default_factory=dict)  # every trial of the grid, per task

    def to_json(self) -> dict:
        return {"lrs": self.lrs, "scores": {t: asdict(s) for t, s in self.scores.items()}, "skipped": self.skipped,
                "grid": {t: [asdict(s) for s in trials] for t, trials in self.grid.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "TeacherProtocol":
        grid = {t: [TaskScore(**s) for s in trials] for t, trials in data.get("grid", {}).items()}
        return cls(data["lrs"], {t: TaskScore(**s) for t, s in data["scores"].items()}, data["skipped"], grid)


@dataclass
class FinetuneProtocolResult:
    lrs: dict[str, float] = field(default_factory=dict)  # task -> lr picked on the teacher
    scores: dict[str, dict[str, TaskScore]] = field(default_factory=dict)  # model -> task -> score
    skipped: dict[str, str] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """``finetuned/<model>/<task>/acc``, ``finetuned/<model>/avg_acc``, ``finetuned/lr/<task>``."""
        out = {f"finetuned/lr/{task}": lr for task, lr in self.lrs.items()}
        for name, per_task in self.scores.items():
            for task, score in per_task.items():
                out[f"finetuned/{name}/{task}/acc"] = score.acc
            if per_task:
                out[f"finetuned/{name}/avg_acc"] = sum(s.acc for s in per_task.values()) / len(per_task)
        return out


def finetune_and_score(model, tokenizer, task: str, pairs, lr: float, cfg: FinetuneProtocolConfig,
                       store=None, who: str = "model") -> TaskScore:
    """Fine-tune a fresh copy of ``model`` on ``pairs``; score after every epoch; pick per protocol.
    ``store`` (:class:`~dofla.eval.finetune_store.TrialStore`): resume the trial from its checkpoint
    and keep its score. ``who`` names the model in the log and in the kill points."""
    return run_trial(model, tokenizer, task, pairs, lr, cfg, store, who)


class TaskSkipped(Exception):
    """A task the protocol cannot train on here (its reason is the message)."""


def run_teacher_protocol(teacher, tokenizer, tasks: list[str], cfg: FinetuneProtocolConfig,
                         pairs_by_task: dict | None = None, store=None) -> TeacherProtocol:
    """Per task, the teacher fine-tuned at every learning rate of ``cfg.lr_grid``; the best is kept
    (ties keep the smaller, earlier rate). Tasks without a training split are skipped, said once.
    ``pairs_by_task``: filled with the training pairs read here, for the students of the same call.
    ``store``: the grid's :class:`~dofla.eval.finetune_store.TrialStore`, shared by the processes that
    compute it (each trial runs once among them, :func:`~dofla.eval.finetune_store.share`); a task's
    training data is read only when one of its trials runs here."""
    runnable, skipped, _ = availability(list(tasks), cfg.task_dirs)
    result = TeacherProtocol({}, {}, dict(skipped))
    pairs_by_task = {} if pairs_by_task is None else pairs_by_task
    for reason in skipped.values():
        logger.warning(reason)

    def compute(task: str, lr: float):
        if task in result.skipped:
            return None
        try:
            pairs = task_pairs(task, teacher, tokenizer, cfg, pairs_by_task)
        except TaskSkipped as why:
            result.skipped[task] = str(why)
            logger.warning(result.skipped[task])
            return None
        return finetune_and_score(teacher, tokenizer, task, pairs, lr, cfg, store, "teacher")

    trials = share(store, [(task, lr) for task in runnable for lr in cfg.lr_grid], compute)
    for task in runnable:
        scores = [trials[task, lr] for lr in cfg.lr_grid]
        if task in result.skipped or any(s is None for s in scores):
            continue
        best = max(scores, key=lambda s: s.acc)
        result.lrs[task], result.scores[task], result.grid[task] = best.lr, best, scores
    return result


def task_pairs(task: str, model, tokenizer, cfg: FinetuneProtocolConfig, pairs_by_task: dict) -> list:
    """The task's training pairs (read once per call chain, kept in ``pairs_by_task``); TaskSkipped
    with one sentence when the task has none here."""
    if task not in pairs_by_task:
        try:
            pairs_by_task[task] = training_pairs(task, model, tokenizer, cfg.task_dirs, cfg.train_limit,
                                                 cfg.train_data.get(task))
        except DownstreamUnavailable as err:
            raise TaskSkipped(f"fine-tune protocol skipped {task}: {err}") from err
    if not pairs_by_task[task]:
        raise TaskSkipped(f"fine-tune protocol skipped {task}: lm-eval defines no training split for it; "
                          f"give one with eval.finetune_train_data.{task}")
    return pairs_by_task[task]


def run_finetune_protocol(teacher, students: dict, tokenizer, tasks: list[str],
                          cfg: FinetuneProtocolConfig | None = None,
                          teacher_result: TeacherProtocol | None = None, stores: dict | None = None
                          ) -> FinetuneProtocolResult:
    """Per task: LR picked on the teacher over ``cfg.lr_grid`` (or taken from ``teacher_result``, the
    teacher's half computed before), reused for every student. ``stores``: a
    :class:`~dofla.eval.finetune_store.TrialStore` per student name (resumable trials).

    ``teacher`` and ``students`` are left untouched (each run trains a deep copy).
    """
    cfg, stores = cfg or FinetuneProtocolConfig(), stores or {}
    pairs_by_task: dict = {}
    if teacher_result is None:
        teacher_result = run_teacher_protocol(teacher, tokenizer, tasks, cfg, pairs_by_task)
    result = FinetuneProtocolResult(lrs=dict(teacher_result.lrs), skipped=dict(teacher_result.skipped))
    result.scores = {"teacher": dict(teacher_result.scores), **{name: {} for name in students}}
    for name, student in students.items():
        def compute(task, lr, student=student, name=name):
            pairs = task_pairs(task, teacher, tokenizer, cfg, pairs_by_task)
            return finetune_and_score(student, tokenizer, task, pairs, lr, cfg, stores.get(name), name)

        scores = share(stores.get(name), list(teacher_result.lrs.items()), compute, name)
        result.scores[name] = {task: scores[task, lr] for task, lr in teacher_result.lrs.items()}
    return result
