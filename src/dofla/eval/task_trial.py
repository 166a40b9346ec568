"""One trial of the fine-tune protocol (a model, a task, a learning rate), resumable, on the loop
harness (:func:`dofla.train.loop.run_loop`).

The trial is ``epochs`` × (steps per epoch) steps of :class:`Trial`; each epoch draws its own order of
examples, and is scored (lm-eval's multiple-choice run) when its steps are done. The loop checkpoints
at every epoch's end, before the scoring (a kill while scoring redoes the scoring only), and every
``checkpoint_every`` steps; the data position (the epoch's order, the generator, the accuracies and
the epoch's losses so far) and the random states travel in the checkpoint with the weights and the
optimiser, so a trial resumed after a kill takes the same steps on the same batches as one that never
stopped. Its score is kept the moment the trial ends (:mod:`dofla.eval.finetune_store`). The step's
backward is :func:`dofla.eval.task_step.finetune_backward`.
"""
from __future__ import annotations

import copy
import logging
import math
import time

import torch

from dofla.eval.downstream import evaluate_tasks
from dofla.eval.task_step import TaskScore, finetune_backward
from dofla.train.checkpoints import one_unit_checkpoint
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, run_loop

logger = logging.getLogger(__name__)


class Trial(Trainer):
    """One model fine-tuned on one task's ``pairs``: one unit (every parameter, AdamW); a step's batch
    is the indices of its examples in the epoch's order, their backward in micro-batches weighted by
    target tokens; an epoch's accuracy is taken when the next epoch starts, or after the last step."""

    own_backward, bar_unit = True, "ex"

    def __init__(self, work, optimizer, tokenizer, task: str, pairs, cfg, who: str, lr: float, epochs: int):
        self.units = {"model": Unit(work, optimizer)}
        self.work, self.tokenizer, self.task, self.pairs, self.cfg = work, tokenizer, task, pairs, cfg
        self.said, self.epochs = f"{who} on {task} at lr {lr:g}", epochs  # who, in the log
        self.batch, self.micro = cfg.batch_for(task), cfg.micro_for(task)
        self.batch_tokens, self.kill = self.batch, f"finetune:{who}:{task}:lr{lr:g}:step"
        self.per_epoch = math.ceil(len(pairs) / self.batch)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.order: list[int] | None = None
        self.accs: list[float] = []
        self.losses: list[float] = []  # each scored epoch's mean training loss
        self.current: list = []  # the current epoch's step losses (device tensors, or floats once checkpointed)
        self.scoring = 0.0  # seconds spent scoring inside the loop (not training time)
        self.steps = 0  # steps whose batches were served

    def next_batch(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.per_epoch)
        self.steps = step + 1
        if len(self.accs) < epoch:  # the epoch before this one is trained: score it first
            started = time.perf_counter()
            self.score(epochs=epoch)
            self.scoring += time.perf_counter() - started
        if within == 0:
            self.order = torch.randperm(len(self.pairs), generator=self.generator).tolist()
        self.work.train()
        return torch.tensor(self.order[within * self.batch : (within + 1) * self.batch])

    def backward(self, key, rows: torch.Tensor, weight: float) -> torch.Tensor:
        loss = finetune_backward(self.work, [self.pairs[i] for i in rows.tolist()], self.cfg.max_length,
                                 self.micro, self.cfg.precision, weight)
        self.current.append(loss)
        return loss

    def wants_checkpoint(self, step: int) -> bool:
        return step % self.per_epoch == 0  # an epoch's end, before its scoring

    def score(self, epochs: int) -> None:
        """Score the trained epoch the accuracies lack (``epochs``: epochs trained)."""
        values = [float(v) for v in self.current]
        finite = [v for v in values if math.isfinite(v)]
        self.losses.append(sum(finite) / len(finite) if finite else float("nan"))
        self.current = []
        self.work.eval()
        result = evaluate_tasks(self.work, self.tokenizer, [self.task], limit=self.cfg.eval_limit,
                                batch_size=self.cfg.eval_batch_size, task_dirs=self.cfg.task_dirs)
        self.accs.append(result.acc(self.task))
        logger.info(f"dofla: fine-tune protocol: {self.said}, epoch {epochs}/{self.epochs}: loss {self.losses[-1]:.4f}, "
              f"acc {self.accs[-1]:.4f}")

    def data_state(self):
        self.current = [float(v) for v in self.current]  # one host read per checkpoint
        return {"generator": self.generator.get_state(), "order": self.order, "accs": list(self.accs),
                "losses": list(self.losses), "current": list(self.current), "scoring": self.scoring,
                "steps": self.steps}

    def restore_data(self, state) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.accs, self.losses = state["order"], list(state["accs"]), list(state["losses"])
        self.current, self.scoring = [v if v is not None else float("nan") for v in state["current"]], state["scoring"]
        self.steps = state["steps"]
        epoch, within = divmod(self.steps, self.per_epoch)
        logger.info(f"dofla: fine-tune protocol: {self.said} resumed at step {self.steps} (epoch {epoch + 1}, step "
              f"{within} of it)")

    def log_values(self, curves) -> dict:
        return {"loss": curves["model"][-1]["loss"]}

    def message(self, key, step: int) -> str:
        return f"fine-tune protocol: {self.said}: non-finite loss at step {step}"


def legacy_checkpoint(saved: dict) -> dict:
    """A trial checkpoint written before the trials ran on the loop harness, in the loop's layout."""
    p = saved["progress"]
    data = {"generator": saved["generator"], "order": p["order"], "accs": p["accs"], "losses": p["losses"],
            "current": p["current"], "scoring": 0.0, "steps": p["steps"]}
    return one_unit_checkpoint(saved["meta"], "model", saved["model"], saved["optimizer"], p["steps"], p["seconds"],
                               data, saved["rng"])


def run_trial(model, tokenizer, task: str, pairs, lr: float, cfg, store=None, who: str = "model") -> TaskScore:
    """Fine-tune a fresh copy of ``model`` on ``pairs`` at ``lr``, scoring it after every epoch; the
    :class:`~dofla.eval.task_step.TaskScore` of the epoch the protocol keeps. With ``store``, the
    trial resumes from its checkpoint and its score is kept there."""
    torch.manual_seed(cfg.seed)
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(work.parameters(), lr=lr, weight_decay=0.0)
    last_only = task in cfg.last_checkpoint_tasks
    epochs = cfg.single_epoch_epochs if last_only else cfg.epochs
    trial = Trial(work, optimizer, tokenizer, task, pairs, cfg, who, lr, epochs)
    loop = LoopConfig(steps=epochs * trial.per_epoch, checkpoint_every=cfg.checkpoint_every,
                      log_every=cfg.log_every, skip_nonfinite=True, precision=cfg.precision)
    checkpoint = Checkpointing(None if store is None else store.checkpoint_path(task, lr),
                               None if store is None else store.meta, legacy=legacy_checkpoint)
    done = run_loop(trial, loop, checkpoint, desc=f"fine-tune {who}:{task}:lr{lr:g}")
    if len(trial.accs) < epochs:
        trial.score(epochs=epochs)
    work.eval()
    accs = trial.accs
    chosen = len(accs) - 1 if last_only else max(range(len(accs)), key=accs.__getitem__)
    score = TaskScore(lr=lr, epoch_accs=accs, chosen_epoch=chosen + 1, acc=accs[chosen], steps=done.step,
                      seconds=done.seconds - trial.scoring)
    logger.info(f"dofla: fine-tune protocol: {who} on {task} at lr {lr:g} done: acc {score.acc:.4f} "
          f"(epoch {score.chosen_epoch}, {score.steps} steps, {score.seconds / max(1, score.steps):.3g} s/step)")
    if store is not None:
        store.save_score(task, lr, score)
    return score
