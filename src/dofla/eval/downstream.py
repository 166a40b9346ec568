"""Zero-shot downstream accuracy through lm-evaluation-harness, on an in-memory model.

The paper's seven tasks are lm-eval's defaults (``DOWNSTREAM7``). Before lm-eval is asked, each
task's datasets are checked in a child process with a timeout, so a machine without hub access
skips what it cannot have with one sentence per task instead of hanging in ``datasets`` retries.
Local tasks (YAML files in ``task_dirs`` with ``dataset_path: json``) run the same code path.
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
__all__ = ["DOWNSTREAM7", "DownstreamUnavailable", "TaskResults", "evaluate_tasks", "write_mmlu_dev_task"]


class DownstreamUnavailable(RuntimeError):
    """None of the requested downstream tasks can run here (their data cannot be had)."""


@dataclass
class TaskResults:
    """Flat metrics ``downstream/<task>/acc|acc_norm`` and ``downstream/avg_acc``, plus skips."""

    metrics: dict[str, float] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # task -> the one-sentence reason

    def acc(self, task: str) -> float:
        return self.metrics[f"downstream/{task}/acc"]


@dataclass(frozen=True)
class DatasetSpec:
    path: str
    name: str | None = None
    data_files: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.path if self.name is None else f"{self.path} ({self.name})"


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


def dataset_specs(manager, task: str) -> list[DatasetSpec]:
    """Every dataset a task (or group, e.g. ``mmlu``'s 57 subjects) reads, from its YAML alone."""
    from lm_eval.tasks._index import Kind  # lazy: lm-eval (the eval extra) takes seconds to import
    from lm_eval.tasks._yaml_loader import load_yaml  # lazy: lm-eval (the eval extra) takes seconds to import

    entry = manager.task_index.get(task)
    if entry is None:
        raise KeyError(f"unknown lm-eval task {task!r}")
    if entry.kind in (Kind.GROUP, Kind.TAG):
        members = _group_members(manager, task, entry)
        return list(dict.fromkeys(s for m in members for s in dataset_specs(manager, m)))
    cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else dict(entry.cfg or {})
    return [_spec_from_config(cfg, entry.yaml_path)]


def _group_members(manager, task: str, entry) -> list[str]:
    from lm_eval.tasks._index import Kind  # lazy: lm-eval (the eval extra) takes seconds to import

    if entry.kind == Kind.TAG:
        return [n for n, e in manager.task_index.items() if task in e.tags]
    items = entry.cfg.get("task", []) if entry.cfg else []
    return [m if isinstance(m, str) else m.get("task") for m in items if m]


def _spec_from_config(cfg: dict, yaml_path: Path | None) -> DatasetSpec:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or ()
    if isinstance(files, dict):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    elif isinstance(files, str):
        files = [files]
    base = yaml_path.parent if yaml_path else Path.cwd()
    files = tuple(str(f if Path(f).is_absolute() else base / f) for f in files)
    return DatasetSpec(str(cfg.get("dataset_path")), cfg.get("dataset_name"), files)


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
        reason = _missing_reason(task, task_specs, available)
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
                   hub_reachable: bool | None = None) -> TaskResults:
    """Zero-shot acc / acc_norm per task on ``model``; tasks whose data cannot be had are skipped.

    ``hub_reachable`` given means the caller already ran :func:`availability` and ``tasks`` are
    the runnable ones (no second probe). Raises ``DownstreamUnavailable`` when none can run.
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
                                    "their datasets are neither reachable nor cached")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    result = TaskResults(skipped=skipped)
    with hub_offline(not reachable):
        for task in runnable:
            try:
                row = run_lm_eval(lm, task, manager_for(task, dirs), limit)
            except (ConnectionError, FileNotFoundError) as err:  # a cache that went stale since the probe
                result.skipped[task] = f"downstream task {task} skipped: its data could not be loaded ({err})"
                logger.warning(result.skipped[task])
                continue
            for metric in ("acc", "acc_norm"):
                if f"{metric},none" in row:
                    result.metrics[f"downstream/{task}/{metric}"] = float(row[f"{metric},none"])
            if "version" in row:
                result.metrics[f"downstream/{task}/version"] = row["version"]
            result.ran.append(task)
    accs = [result.acc(t) for t in result.ran if f"downstream/{t}/acc" in result.metrics]
    if accs:
        result.metrics["downstream/avg_acc"] = sum(accs) / len(accs)
    return result
