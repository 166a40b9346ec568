"""Zero-shot downstream accuracy through lm-evaluation-harness, on an in-memory model.

The paper's seven tasks are lm-eval's defaults (``DOWNSTREAM7``). Before lm-eval is asked, each
task's datasets are checked in a child process with a timeout, so a machine without hub access
skips what it cannot have with one sentence per task instead of hanging in ``datasets`` retries.
Local tasks (YAML files in ``task_dirs`` with ``dataset_path: json``) run the same code path. Tasks
that build their own data (RULER's needle tasks) need no probe and run at the lengths the model
reaches (:mod:`dofla.eval.synthetic_tasks`); every numeric metric lm-eval reports is kept.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import huggingface_hub.constants as hub_constants

from dofla.eval.mmlu_dev import write_mmlu_dev_task
from dofla.eval.synthetic_tasks import RULER_LENGTHS, length_manager, length_metrics, reachable_lengths, saved_tokenizer
from dofla.eval.task_specs import DatasetSpec, builds_own_data, code_problem, dataset_specs

logger = logging.getLogger(__name__)

# lm-eval names. ``wsc`` is SuperGLUE WSC (aps/super_glue, wsc.fixed; validation has 104 docs);
# lm-eval's other WSC, ``wsc273``, is the Winograd schema set the paper did not use.
DOWNSTREAM7 = ("piqa", "logiqa", "arc_easy", "arc_challenge", "winogrande", "mmlu", "wsc")
# Training examples of the seven tasks as the fine-tune protocol reads them (lm-eval's training splits;
# winogrande: winogrande_xl; mmlu: cais/mmlu auxiliary_train, eval=downstream7's finetune_train_data):
# the startup estimate's count, before any data is read (dofla.stages.estimate)
TRAIN_EXAMPLES = {"piqa": 16_113, "logiqa": 7_376, "arc_easy": 2_251, "arc_challenge": 1_119,
                  "winogrande": 40_398, "mmlu": 99_842, "wsc": 554}
PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
PROBE_SCRIPT = Path(__file__).with_name("dataset_probe.py")
__all__ = ["DOWNSTREAM7", "DatasetSpec", "dataset_specs", "DownstreamUnavailable", "TaskResults", "evaluate_tasks", "write_mmlu_dev_task"]


class DownstreamUnavailable(RuntimeError):
    """None of the requested downstream tasks can run here (their data cannot be had)."""


@dataclass
class TaskResults:
    """Flat metrics ``downstream/<task>/<metric>`` (every numeric metric lm-eval reports) and
    ``downstream/avg_acc`` (over the tasks reporting ``acc``), plus skips."""

    metrics: dict[str, float] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # task -> the one-sentence reason

    def acc(self, task: str) -> float:
        return self.metrics[f"downstream/{task}/acc"]


@lru_cache(maxsize=8)
def task_manager(task_dirs: tuple[str, ...] = (), include_defaults: bool = True):
    """One cached TaskManager per (dirs, defaults): indexing lm-eval's own tasks takes ~10 s."""
    from lm_eval.tasks import TaskManager  # lazy: lm-eval (the eval extra) takes seconds to import

    return TaskManager(include_path=list(task_dirs) or None, include_defaults=include_defaults)


def manager_for(task: str, task_dirs: tuple[str, ...]):
    """The local-only manager when ``task`` is defined in ``task_dirs`` (cheap), else the full one."""
    if task_dirs:
        local = task_manager(task_dirs, include_defaults=False)
        if task in local.task_index:
            return local
    return task_manager((), include_defaults=True)


def probe_hub_datasets(specs: list[DatasetSpec], timeout_s: float = 60.0) -> tuple[bool, dict]:
    """(hub reachable, {spec: available}) from the child-process probe; a timeout means neither."""
    if not specs:
        return False, {}
    payload = json.dumps([{"path": s.path, "name": s.name} for s in specs])
    try:
        done = subprocess.run([sys.executable, str(PROBE_SCRIPT)], input=payload, text=True,
                              capture_output=True, timeout=timeout_s, check=True)
        answer = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError, json.JSONDecodeError):
        return False, {s: False for s in specs}
    return answer["hub_reachable"], dict(zip(specs, answer["available"]))


def availability(tasks: list[str], task_dirs: tuple[str, ...], timeout_s: float = 60.0):
    """(runnable tasks, {skipped task: reason}, hub reachable) without asking lm-eval for data."""
    specs = {t: dataset_specs(manager_for(t, task_dirs), t) for t in tasks}
    hub = [s for ss in specs.values() for s in ss if s.path not in PACKAGED_BUILDERS]
    reachable, available = probe_hub_datasets(list(dict.fromkeys(hub)), timeout_s)
    runnable, skipped = [], {}
    for task, task_specs in specs.items():
        reason = code_problem(manager_for(task, task_dirs), task) or _missing_reason(task, task_specs, available)
        if reason:
            skipped[task] = reason
        else:
            runnable.append(task)
    return runnable, skipped, reachable


def _missing_reason(task: str, specs: list[DatasetSpec], available: dict) -> str | None:
    for spec in specs:
        missing_files = [f for f in spec.data_files if not Path(f).exists()]
        if spec.path in PACKAGED_BUILDERS and (missing_files or not spec.data_files):
            return (f"downstream task {task} skipped: its local {spec.path} data files "
                    f"{missing_files or '(none given)'} do not exist")
    lost = [s for s in specs if s.path not in PACKAGED_BUILDERS and not available.get(s, False)]
    if lost:
        what = lost[0].path if len(lost) == 1 else f"{lost[0].path} ({len(lost)} configs)"
        return (f"downstream task {task} skipped: its dataset {what} cannot be downloaded "
                "(no network or hub access) and is not in the local HF cache; "
                "run once with network access to cache it")
    return None


@contextlib.contextmanager
def hub_offline(enabled: bool = True):
    """Offline mode for this process while lm-eval loads cached data (else ~25 s of retries each)."""
    if not enabled:
        yield
        return
    import datasets.config  # lazy: datasets (hub data only) takes seconds to import

    saved = (hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, dict(os.environ))
    hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])


def run_lm_eval(lm, task: str, manager, limit: int | None) -> dict:
    """lm-eval's result row for one task (or group), zero-shot, no bootstrap (stderr is not used), with
    the task's version under ``version`` when lm-eval reports one (a number: the model card shows it)."""
    import lm_eval  # lazy: lm-eval (the eval extra) takes seconds to import

    out = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=0, limit=limit,
                                  task_manager=manager, log_samples=False, bootstrap_iters=0)
    row = dict(out["results"][task])
    try:
        row["version"] = float((out.get("versions") or {})[task])
    except (KeyError, TypeError, ValueError):  # a group, or a version that is not a number
        pass
    return row


def evaluate_tasks(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 1,
                   task_dirs: list[Path] = (), probe_timeout_s: float = 60.0,
                   hub_reachable: bool | None = None, seq_lengths: list[int] | None = None) -> TaskResults:
    """Zero-shot scores per task on ``model``: every numeric metric lm-eval reports
    (:func:`row_metrics`); tasks whose data cannot be had are skipped.

    ``hub_reachable`` given means the caller already ran :func:`availability` and ``tasks`` are
    the runnable ones (no second probe). A task that builds its own data (RULER) runs at each of
    ``seq_lengths`` (None: RULER's lengths) that fits the model's context, ``limit`` documents each.
    Raises ``DownstreamUnavailable`` when none can run.
    """
    from lm_eval.models.huggingface import HFLM  # lazy: lm-eval (the eval extra) takes seconds to import

    dirs = tuple(str(Path(d).resolve()) for d in task_dirs)
    if hub_reachable is None:
        runnable, skipped, reachable = availability(list(tasks), dirs, probe_timeout_s)
    else:
        runnable, skipped, reachable = list(tasks), {}, hub_reachable
    for reason in skipped.values():
        logger.warning(reason)
    if not runnable:
        raise DownstreamUnavailable(f"none of the downstream tasks {list(tasks)} can run here: "
                                    "the lines above say why for each")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    result = TaskResults(skipped=skipped)
    synthetic = any(builds_own_data(manager_for(task, dirs), task) for task in runnable)
    with hub_offline(not reachable), (saved_tokenizer(tokenizer) if synthetic else contextlib.nullcontext()) as tokenizer_dir:
        for task in runnable:
            manager = manager_for(task, dirs)
            try:
                rows = _task_rows(lm, task, manager, limit, seq_lengths, tokenizer_dir)
            except (ConnectionError, FileNotFoundError) as err:  # a cache that went stale since the probe
                rows = f"downstream task {task} skipped: its data could not be loaded ({err})"
            if isinstance(rows, str):
                result.skipped[task] = rows
                logger.warning(rows)
                continue
            for row in rows:
                result.metrics.update(row_metrics(task, row))
            result.ran.append(task)
    accs = [result.acc(t) for t in result.ran if f"downstream/{t}/acc" in result.metrics]
    if accs:
        result.metrics["downstream/avg_acc"] = sum(accs) / len(accs)
    return result


def _task_rows(lm, task: str, manager, limit: int | None, seq_lengths, tokenizer_dir: str) -> list[dict] | str:
    """lm-eval's result rows for one task: one row, or one per length for a task that builds its own
    data; a string (the one-sentence reason) when no length fits the model."""
    if not builds_own_data(manager, task):
        return [run_lm_eval(lm, task, manager, limit)]
    lengths = reachable_lengths(lm.max_length, seq_lengths)
    if not lengths:
        return (f"downstream task {task} skipped: none of its lengths {list(seq_lengths or RULER_LENGTHS)} "
                f"fits the model's context of {lm.max_length} tokens; ask for shorter ones")
    yaml_path = manager.task_index[task].yaml_path
    return [length_metrics(run_lm_eval(lm, task, length_manager(yaml_path, tokenizer_dir, n), limit))
            for n in lengths]


def row_metrics(task: str, row: dict) -> dict[str, float]:
    """``downstream/<task>/<metric>`` for every numeric ``metric,filter`` of lm-eval's row (the
    filter named only when it is not ``none``: ``acc``, ``exact_match,strict-match``, RULER's
    ``1024``), standard errors left out, and ``downstream/<task>/version`` when reported."""
    out = {}
    for key, value in row.items():
        metric, comma, filt = key.partition(",")
        if not comma or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[f"downstream/{task}/{metric if filt == 'none' else key}"] = float(value)
    if "version" in row:
        out[f"downstream/{task}/version"] = row["version"]
    return out
