"""One trial of the fine-tune protocol (a model, a task, a learning rate), resumable.

The trial's position (epoch, steps done in it, that epoch's order of examples, the accuracies so
far) and the random states travel in its checkpoint with the weights and the optimiser, so a trial
resumed after a kill takes the same steps on the same batches as one that never stopped. A
checkpoint is written when an epoch's training ends (before it is scored) and every
``checkpoint_every`` steps; its score is kept the moment the trial ends (:mod:`dofla.eval.finetune_store`).
The step itself is :func:`dofla.eval.task_step.finetune_step`.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from dofla.eval.downstream import evaluate_tasks
from dofla.eval.task_step import TaskScore, finetune_step
from dofla.faults import kill_point


@dataclass
class TrialProgress:
    epoch: int = 0  # epochs trained and scored
    step: int = 0  # steps done in the current epoch
    order: list[int] | None = None  # the current epoch's order of examples
    trained: bool = False  # the current epoch's steps are all done (it is scored next)
    accs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # each epoch's mean training loss
    current: list[float | None] = field(default_factory=list)  # the current epoch's step losses so far
    steps: int = 0  # optimiser steps in all
    seconds: float = 0.0  # their wall time


def run_trial(model, tokenizer, task: str, pairs, lr: float, cfg, store=None, who: str = "model"):
    """Fine-tune a fresh copy of ``model`` on ``pairs`` at ``lr``, scoring it after every epoch; the
    :class:`~dofla.eval.task_step.TaskScore` of the epoch the protocol keeps. With ``store``, the
    trial resumes from its checkpoint and its score is kept there."""
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(work.parameters(), lr=lr, weight_decay=0.0)
    last_only = task in cfg.last_checkpoint_tasks
    epochs = cfg.single_epoch_epochs if last_only else cfg.epochs
    progress = resume(store, task, lr, work, optimizer, generator, who)

    def save():
        if store is not None:
            store.save_checkpoint(task, lr, {"model": work.state_dict(), "optimizer": optimizer.state_dict(),
                                             "progress": asdict(progress), "generator": generator.get_state(),
                                             "rng": random_states()})

    while progress.epoch < epochs:
        if not progress.trained:
            train_epoch(work, pairs, optimizer, cfg, task, generator, progress, save, f"{who}:{task}:lr{lr:g}")
            save()  # before scoring: a kill while scoring redoes the scoring only
        result = evaluate_tasks(work, tokenizer, [task], limit=cfg.eval_limit, batch_size=cfg.eval_batch_size,
                                task_dirs=cfg.task_dirs)
        progress.accs.append(result.acc(task))
        progress.epoch, progress.step, progress.order, progress.trained = progress.epoch + 1, 0, None, False
        per_step = progress.seconds / max(1, progress.steps)
        print(f"dofla: fine-tune protocol: {who} on {task} at lr {lr:g}, epoch {progress.epoch}/{epochs}: "
              f"loss {progress.losses[-1]:.4f}, acc {progress.accs[-1]:.4f} ({per_step:.3g} s/step)", flush=True)
    accs = progress.accs
    chosen = len(accs) - 1 if last_only else max(range(len(accs)), key=accs.__getitem__)
    score = TaskScore(lr=lr, epoch_accs=accs, chosen_epoch=chosen + 1, acc=accs[chosen], steps=progress.steps,
                      seconds=progress.seconds)
    print(f"dofla: fine-tune protocol: {who} on {task} at lr {lr:g} done: acc {score.acc:.4f} "
          f"(epoch {score.chosen_epoch}, {score.steps} steps)", flush=True)
    if store is not None:
        store.save_score(task, lr, score)
    return score


def resume(store, task: str, lr: float, work, optimizer, generator, who: str) -> TrialProgress:
    """The trial's progress, restored with weights, optimiser and random states from its checkpoint
    when ``store`` has one; a fresh start otherwise."""
    ckpt = store.checkpoint(task, lr) if store is not None else None
    if ckpt is None:
        return TrialProgress()
    work.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    generator.set_state(ckpt["generator"])
    restore_random_states(ckpt["rng"])
    progress = TrialProgress(**ckpt["progress"])
    print(f"dofla: fine-tune protocol: {who} on {task} at lr {lr:g} resumed at step {progress.steps} "
          f"(epoch {progress.epoch + 1}, step {progress.step} of it)", flush=True)
    return progress


def train_epoch(work, pairs, optimizer, cfg, task: str, generator, progress: TrialProgress, save, name: str) -> None:
    """The rest of the current epoch's steps; losses reach the host every ``cfg.log_every`` steps;
    ``save()`` every ``cfg.checkpoint_every`` steps."""
    if progress.order is None:
        progress.order, progress.current = torch.randperm(len(pairs), generator=generator).tolist(), []
    batch, micro, order = cfg.batch_for(task), cfg.micro_for(task), progress.order
    work.train()
    pending: list[torch.Tensor] = []
    started = time.perf_counter()
    bar = tqdm(total=math.ceil(len(order) / batch), initial=progress.step, desc=f"fine-tune {name}", leave=False)

    def flush():
        nonlocal started
        if pending:
            values = torch.stack(pending).tolist()  # one host synchronisation for the held losses
            progress.current.extend(v if math.isfinite(v) else None for v in values)
            bar.set_postfix(loss=f"{values[-1]:.4f}")
            pending.clear()
        now = time.perf_counter()
        progress.seconds += now - started
        started = now

    for start in range(progress.step * batch, len(order), batch):
        kill_point(f"finetune:{name}:step{progress.steps}")
        pending.append(finetune_step(work, optimizer, [pairs[i] for i in order[start : start + batch]],
                                     cfg.max_length, micro, cfg.precision))
        progress.step, progress.steps = progress.step + 1, progress.steps + 1
        bar.update(1)
        if len(pending) >= max(1, cfg.log_every):
            flush()
        if cfg.checkpoint_every and progress.steps % cfg.checkpoint_every == 0 and start + batch < len(order):
            flush()
            save()
    flush()
    bar.close()
    work.eval()
    finite = [v for v in progress.current if v is not None]
    progress.losses.append(sum(finite) / len(finite) if finite else float("nan"))
    progress.trained = True


def random_states() -> dict:
    """The global random states a trial's dropout draws from (CPU, and every CUDA device's)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_random_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
