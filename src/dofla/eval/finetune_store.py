"""Where the fine-tune protocol's trials are kept, so that a killed or requeued job resumes where it
stopped and the cells of a sweep share the teacher's grid.

A trial is one model fine-tuned on one task at one learning rate. Per trial a :class:`TrialStore`
keeps, under ``directory/<task>/lr<lr>``:

- ``.json``: the finished :class:`~dofla.eval.task_step.TaskScore`, written as soon as the trial ends;
- ``.pt``: the checkpoint of the trial in progress (the loop harness's: weights, optimiser, position in the
  epoch's order, random states), written at every epoch end and every ``checkpoint_every`` steps;
- ``.lock``: held by the process running the trial (:func:`claim`), so that two processes sharing
  the directory never run the same trial; the operating system releases it when a process dies.

Both files record the store's ``meta`` (the model's and the protocol's settings): a file written
for other settings is ignored, never trusted. :func:`share` runs a list of trials with other
processes: each runs the trials nobody holds, then waits for the others' and reads their scores.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from dofla.artifacts import canonical
from dofla.eval.task_step import TaskScore
from dofla.record import read_json, write_json

logger = logging.getLogger(__name__)


class TrialStore:
    """One model's trials under ``directory``, keyed by ``meta``; ``checkpoint_every``: steps between
    the checkpoints taken inside an epoch (0: at epoch ends only)."""

    def __init__(self, directory: Path, meta: dict, checkpoint_every: int = 0):
        self.directory, self.meta, self.checkpoint_every = Path(directory), canonical(meta), checkpoint_every

    def _path(self, task: str, lr: float, suffix: str) -> Path:
        return self.directory / task / f"lr{lr:g}{suffix}"

    def score(self, task: str, lr: float):
        """The trial's finished score, or None (not run, or run for other settings)."""
        kept = read_json(self._path(task, lr, ".json"))
        if kept is None or kept.get("meta") != self.meta:
            return None
        return TaskScore(**kept["score"])

    def save_score(self, task: str, lr: float, score) -> None:
        """Keep the finished score; the trial's checkpoint is no longer needed."""
        write_json(self._path(task, lr, ".json"), {"meta": self.meta, "score": asdict(score)})
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(task, lr, ".pt"))

    def checkpoint_path(self, task: str, lr: float) -> Path:
        """Where the trial in progress keeps its checkpoint (written with this store's meta)."""
        return self._path(task, lr, ".pt")

    @contextlib.contextmanager
    def claim(self, task: str, lr: float, wait: bool):
        """Hold the trial's lock inside the block; yields False (without waiting) when another process
        holds it and ``wait`` is false."""
        path = self._path(task, lr, ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()


def share(store: TrialStore | None, trials: list[tuple[str, float]], compute: Callable, who: str = "teacher") -> dict:
    """``{(task, lr): score}`` for every trial, each computed once among the processes sharing ``store``:
    kept scores are read; a free trial is claimed and computed (``compute(task, lr)``, which resumes from
    the trial's checkpoint and saves its score); a trial another process holds is left for later, then
    waited for. A trial whose holder died without a score is computed here, from its checkpoint."""
    if store is None:
        return {(task, lr): compute(task, lr) for task, lr in trials}
    done: dict = {}
    for wait in (False, True):
        for task, lr in trials:
            if (task, lr) in done:
                continue
            score = store.score(task, lr)
            if score is None:
                with store.claim(task, lr, wait) as held:
                    if not held:
                        continue
                    score = store.score(task, lr)  # finished while this process waited for the lock
                    if score is None:
                        score = compute(task, lr)
                    else:
                        logger.info(f"dofla: fine-tune protocol: {who} on {task} at lr {lr:g} finished by another job")
            done[task, lr] = score
        if len(done) < len(trials) and not wait:
            held = [f"{t} at lr {lr:g}" for t, lr in trials if (t, lr) not in done]
            logger.info(f"dofla: fine-tune protocol: waiting for other jobs running the {who}'s {', '.join(held)} "
                  f"({store.directory})")
    return done

