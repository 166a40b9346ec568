"""The paper's downstream protocol: fine-tune a fresh copy of each model per task, then score it.

Per task (METHOD §5): the learning rate is picked on the teacher from ``lr_grid`` and reused for
every student; each model trains for ``epochs`` epochs on the task's training split and keeps its
best epoch by eval accuracy (``last_checkpoint_tasks``, e.g. MMLU: ``single_epoch_epochs`` epoch,
last checkpoint). Training examples are lm-eval's own (context, correct continuation) pairs,
tokenised by lm-eval, with next-token loss on the continuation only; scoring is the same lm-eval
multiple-choice run as ``evaluate_tasks``. Selecting the epoch on the eval split is the paper's
(optimistic) choice, applied identically to teacher and students.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofla.eval.downstream import availability, evaluate_tasks, manager_for


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

    def __post_init__(self):
        self.task_dirs = tuple(str(Path(d).resolve()) for d in self.task_dirs)

    def batch_for(self, task: str) -> int:
        return dict(self.task_batch_sizes).get(task, self.batch_size)


@dataclass
class TaskScore:
    lr: float
    epoch_accs: list[float]
    chosen_epoch: int  # 1-based
    acc: float


@dataclass
class TeacherProtocol:
    """The teacher's half of the protocol, the same for every student of that teacher: the learning
    rate picked per task, the teacher's scores at it and the tasks skipped (kept across runs as JSON)."""

    lrs: dict[str, float]
    scores: dict[str, TaskScore]
    skipped: dict[str, str]

    def to_json(self) -> dict:
        return {"lrs": self.lrs, "scores": {t: asdict(s) for t, s in self.scores.items()}, "skipped": self.skipped}

    @classmethod
    def from_json(cls, data: dict) -> "TeacherProtocol":
        return cls(data["lrs"], {t: TaskScore(**s) for t, s in data["scores"].items()}, data["skipped"])


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


def training_pairs(task: str, model, tokenizer, task_dirs: tuple[str, ...] = (),
                   limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """[(context ids, continuation ids)] of the correct answers in the task's training split(s)."""
    from lm_eval.models.huggingface import HFLM

    leaves = manager_for(task, task_dirs).load([task])["tasks"].values()
    encoder = HFLM(pretrained=model, tokenizer=tokenizer)  # lm-eval's own pair tokenisation
    pairs = []
    for leaf in leaves:
        if leaf.has_training_docs():
            for doc in list(leaf.training_docs())[:limit]:
                pairs.append(encoder._encode_pair(*gold_text(leaf, doc)))
    return pairs


def gold_text(task, doc) -> tuple[str, str]:
    """The (context, delimiter + correct choice) pair that lm-eval scores as the right answer."""
    delimiter = task.config.target_delimiter
    if task.multiple_input:  # winogrande: choices are contexts, doc_to_text is the gold index
        return task.doc_to_choice(doc)[task.doc_to_text(doc)], f"{delimiter}{task.doc_to_target(doc)}"
    choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
    target = target[0] if isinstance(target, list) else target
    if isinstance(target, str) and target not in choices and target.isdigit():
        target = int(target)
    gold = choices[target] if isinstance(target, int) else target
    return task.fewshot_context(doc, num_fewshot=0), f"{delimiter}{gold}"


def pad_batch(pairs, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded: with causal attention the padding never reaches a real
    token, so no attention mask is needed (linear-attention students may ignore one anyway)."""
    rows = []
    for context, continuation in pairs:
        ids = (context + continuation)[-max_length:]  # drop the oldest context tokens first
        n_target = min(len(continuation), len(ids) - 1)
        rows.append((ids, [-100] * (len(ids) - n_target) + ids[len(ids) - n_target :]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return input_ids, labels


def train_one_epoch(model, pairs, optimizer, cfg: FinetuneProtocolConfig, generator, batch_size: int) -> float:
    """One shuffled pass of next-token loss on the continuations; returns the mean batch loss."""
    device = next(model.parameters()).device
    order = torch.randperm(len(pairs), generator=generator).tolist()
    model.train()
    losses = []
    for start in tqdm(range(0, len(order), batch_size), desc="task finetune", leave=False):
        input_ids, labels = pad_batch([pairs[i] for i in order[start : start + batch_size]], cfg.max_length)
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device), use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return sum(losses) / max(1, len(losses))


def finetune_and_score(model, tokenizer, task: str, pairs, lr: float,
                       cfg: FinetuneProtocolConfig) -> TaskScore:
    """Fine-tune a fresh copy of ``model`` on ``pairs``; score after every epoch; pick per protocol."""
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(work.parameters(), lr=lr, weight_decay=0.0)
    last_only = task in cfg.last_checkpoint_tasks
    accs = []
    for _ in range(cfg.single_epoch_epochs if last_only else cfg.epochs):
        train_one_epoch(work, pairs, optimizer, cfg, generator, cfg.batch_for(task))
        result = evaluate_tasks(work, tokenizer, [task], limit=cfg.eval_limit,
                                batch_size=cfg.eval_batch_size, task_dirs=cfg.task_dirs)
        accs.append(result.acc(task))
    chosen = len(accs) - 1 if last_only else max(range(len(accs)), key=accs.__getitem__)
    del work, optimizer
    return TaskScore(lr=lr, epoch_accs=accs, chosen_epoch=chosen + 1, acc=accs[chosen])


def run_teacher_protocol(teacher, tokenizer, tasks: list[str], cfg: FinetuneProtocolConfig,
                         pairs_by_task: dict | None = None) -> TeacherProtocol:
    """Per task, the teacher fine-tuned at every learning rate of ``cfg.lr_grid``; the best is kept
    (ties keep the smaller, earlier rate). Tasks without a training split are skipped, said once.
    ``pairs_by_task``: filled with each task's training pairs, for the students of the same call."""
    runnable, skipped, _ = availability(list(tasks), cfg.task_dirs)
    result = TeacherProtocol({}, {}, dict(skipped))
    pairs_by_task = {} if pairs_by_task is None else pairs_by_task
    for reason in skipped.values():
        print(reason, flush=True)
    for task in runnable:
        pairs = pairs_by_task[task] = training_pairs(task, teacher, tokenizer, cfg.task_dirs, cfg.train_limit)
        if not pairs:
            result.skipped[task] = f"fine-tune protocol skipped {task}: lm-eval defines no training split for it"
            print(result.skipped[task], flush=True)
            continue
        trials = [finetune_and_score(teacher, tokenizer, task, pairs, lr, cfg) for lr in cfg.lr_grid]
        best = max(trials, key=lambda s: s.acc)
        result.lrs[task], result.scores[task] = best.lr, best
    return result


def run_finetune_protocol(teacher, students: dict, tokenizer, tasks: list[str],
                          cfg: FinetuneProtocolConfig | None = None,
                          teacher_result: TeacherProtocol | None = None) -> FinetuneProtocolResult:
    """Per task: LR picked on the teacher over ``cfg.lr_grid`` (or taken from ``teacher_result``, the
    teacher's half computed before), reused for every student.

    ``teacher`` and ``students`` are left untouched (each run trains a deep copy).
    """
    cfg = cfg or FinetuneProtocolConfig()
    pairs_by_task: dict = {}
    if teacher_result is None:
        teacher_result = run_teacher_protocol(teacher, tokenizer, tasks, cfg, pairs_by_task)
    result = FinetuneProtocolResult(lrs=dict(teacher_result.lrs), skipped=dict(teacher_result.skipped))
    result.scores = {"teacher": dict(teacher_result.scores), **{name: {} for name in students}}
    for task, lr in teacher_result.lrs.items():
        pairs = pairs_by_task.get(task) or training_pairs(task, teacher, tokenizer, cfg.task_dirs, cfg.train_limit)
        for name, student in students.items():
            result.scores[name][task] = finetune_and_score(student, tokenizer, task, pairs, lr, cfg)
    return result
