"""The paper's downstream protocol: fine-tune a fresh copy of each model per task, then score it.

Per task (METHOD §5): the learning rate is picked on the teacher from ``lr_grid`` and reused for
every student; each model trains for ``epochs`` epochs on the task's training split and keeps its
best epoch by eval accuracy (``last_checkpoint_tasks``, e.g. MMLU: ``single_epoch_epochs`` epoch,
last checkpoint). Training examples are lm-eval's own (context, correct continuation) pairs,
tokenised by lm-eval, with next-token loss on the continuation only. A task lm-eval defines no
training split for (MMLU) trains on ``train_data[task]`` instead (the paper: MMLU's
auxiliary_train), its rows formatted by the task's own prompt (:func:`extra_training_docs`); scoring is the same lm-eval
multiple-choice run as ``evaluate_tasks``. Selecting the epoch on the eval split is the paper's
(optimistic) choice, applied identically to teacher and students.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofla.eval.downstream import DownstreamUnavailable, availability, evaluate_tasks, manager_for


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
                   limit: int | None = None, train_data: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """[(context ids, continuation ids)] of the correct answers in the task's training split(s), or,
    when ``train_data`` is given, in those rows (formatted by the task's first subtask)."""
    from lm_eval.models.huggingface import HFLM

    leaves = list(manager_for(task, task_dirs).load([task])["tasks"].values())
    encoder = HFLM(pretrained=model, tokenizer=tokenizer)  # lm-eval's own pair tokenisation
    if train_data:
        leaf = leaves[0]  # a group's subtasks (MMLU's 57 subjects) share one prompt format
        return [encoder._encode_pair(*gold_text(leaf, doc, description=False))
                for doc in extra_training_docs(task, train_data, limit)]
    pairs = []
    for leaf in leaves:
        if leaf.has_training_docs():
            for doc in list(leaf.training_docs())[:limit]:
                pairs.append(encoder._encode_pair(*gold_text(leaf, doc)))
    return pairs


def extra_training_docs(task: str, spec: dict, limit: int | None = None) -> list[dict]:
    """The rows of ``spec`` (``{path, name, split}`` on the hub or ``{files: [...]}`` of JSON lines),
    the first ``limit`` of them; one sentence naming the setting when they cannot be read."""
    import datasets

    from dofla.eval.suite import train_data_problem

    problem = train_data_problem(spec, task)
    if problem:
        raise ValueError(problem)
    split = spec.get("split", "train")
    if limit is not None:
        split = f"{split}[:{limit}]"
    try:
        if "files" in spec:
            rows = datasets.load_dataset("json", data_files=[str(Path(p).expanduser()) for p in spec["files"]],
                                         split=split)
        else:
            rows = datasets.load_dataset(spec["path"], spec.get("name"), split=split)
    except Exception as err:  # noqa: BLE001 - offline, missing files, bad names: one sentence
        raise DownstreamUnavailable(
            f"the fine-tune training data of {task} (eval.finetune_train_data.{task}={spec}) cannot be "
            f"read: {str(err).splitlines()[0]}; run once with hub access to cache it, or point it at local files"
        ) from err
    # cais/mmlu's auxiliary_train once nested each row under "train"
    return [row["train"] if set(row) == {"train"} else dict(row) for row in rows]


def gold_text(task, doc, description: bool = True) -> tuple[str, str]:
    """The (context, delimiter + correct choice) pair that lm-eval scores as the right answer;
    ``description=False`` leaves out the task's description (an MMLU subject's "about <subject>"
    line, wrong for rows from other sources)."""
    delimiter = task.config.target_delimiter
    if task.multiple_input:  # winogrande: choices are contexts, doc_to_text is the gold index
        return task.doc_to_choice(doc)[task.doc_to_text(doc)], f"{delimiter}{task.doc_to_target(doc)}"
    choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
    target = target[0] if isinstance(target, list) else target
    if isinstance(target, str) and target not in choices and target.isdigit():
        target = int(target)
    gold = choices[target] if isinstance(target, int) else target
    context = task.fewshot_context(doc, num_fewshot=0) if description else task.doc_to_text(doc)
    return context, f"{delimiter}{gold}"


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
        try:
            pairs = pairs_by_task[task] = training_pairs(task, teacher, tokenizer, cfg.task_dirs, cfg.train_limit,
                                                         cfg.train_data.get(task))
        except DownstreamUnavailable as err:
            result.skipped[task] = f"fine-tune protocol skipped {task}: {err}"
            print(result.skipped[task], flush=True)
            continue
        if not pairs:
            result.skipped[task] = (f"fine-tune protocol skipped {task}: lm-eval defines no training split for it; "
                                    f"give one with eval.finetune_train_data.{task}")
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
        pairs = pairs_by_task.get(task) or training_pairs(task, teacher, tokenizer, cfg.task_dirs, cfg.train_limit,
                                                          cfg.train_data.get(task))
        for name, student in students.items():
            result.scores[name][task] = finetune_and_score(student, tokenizer, task, pairs, lr, cfg)
    return result
