"""What an lm-eval task reads, from its YAML and the code it names, before any data is loaded.

Three kinds of task: a YAML task names its hub or local dataset (``dataset_path``); a Python task
(``class: !function task.SWDE``: ``swde``, ``fda``, ``squad_completion``) names it on its class
(``DATASET_PATH``); a task that builds its own data (``custom_dataset: !function ...``: RULER's
synthetic needle tasks) reads no dataset, unless its generator reads one for its haystack
(:data:`GENERATOR_DATASETS`). Only hub datasets go to the availability probe.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetSpec:
    path: str
    name: str | None = None
    data_files: tuple[str, ...] = ()

    def describe(self) -> str:
        return self.path if self.name is None else f"{self.path} ({self.name})"


# Generators of synthetic tasks that read a hub dataset, by function name: RULER's essay haystack
# (lm-eval's tasks/ruler/prepare_niah.py, get_haystack("essay")). The repeat and needle haystacks
# (niah_single_1, niah_multikey_2/3) are built from fixed sentences and need nothing.
PAUL_GRAHAM_ESSAYS = DatasetSpec("baber/paul_graham_essays")
GENERATOR_DATASETS = {name: (PAUL_GRAHAM_ESSAYS,) for name in
                      ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")}


def task_config(manager, task: str) -> tuple[object, dict]:
    """(index entry, YAML config with ``!function`` references left as strings) of one task."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lazy: lm-eval (the eval extra) takes seconds to import

    entry = manager.task_index.get(task)
    if entry is None:
        raise KeyError(f"unknown lm-eval task {task!r}")
    cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else dict(entry.cfg or {})
    return entry, cfg


def is_group(entry) -> bool:
    from lm_eval.tasks._index import Kind  # lazy: lm-eval (the eval extra) takes seconds to import

    return entry.kind in (Kind.GROUP, Kind.TAG)


def group_members(manager, task: str, entry) -> list[str]:
    from lm_eval.tasks._index import Kind  # lazy: lm-eval (the eval extra) takes seconds to import

    if entry.kind == Kind.TAG:
        return [n for n, e in manager.task_index.items() if task in e.tags]
    items = entry.cfg.get("task", []) if entry.cfg else []
    return [m if isinstance(m, str) else m.get("task") for m in items if m]


def dataset_specs(manager, task: str) -> list[DatasetSpec]:
    """Every dataset a task (or group, e.g. ``mmlu``'s 57 subjects) reads: none for a task that
    builds its own data from fixed text, the class's for a Python task."""
    entry, cfg = task_config(manager, task)
    if is_group(entry):
        members = group_members(manager, task, entry)
        return list(dict.fromkeys(s for m in members for s in dataset_specs(manager, m)))
    if cfg.get("custom_dataset"):
        return list(GENERATOR_DATASETS.get(_function_name(cfg["custom_dataset"]), ()))
    if cfg.get("class"):
        try:
            cls = _resolve(cfg["class"])
        except ImportError:  # code_problem() says so, in one sentence
            return []
        path = getattr(cls, "DATASET_PATH", None)
        return [DatasetSpec(str(path), getattr(cls, "DATASET_NAME", None))] if path else []
    return [_spec_from_config(cfg, entry.yaml_path)]


def builds_own_data(manager, task: str) -> bool:
    """Whether the task generates its documents (``custom_dataset``) instead of loading a dataset."""
    entry, cfg = task_config(manager, task)
    return not is_group(entry) and bool(cfg.get("custom_dataset"))


def code_problem(manager, task: str) -> str | None:
    """One sentence when the code a task names (its class or data generator) cannot be imported here,
    e.g. RULER's generators without ``wonderwords`` and ``nltk``; None when it imports."""
    entry, cfg = task_config(manager, task)
    if is_group(entry):
        return None
    reference = cfg.get("custom_dataset") or cfg.get("class")
    if not isinstance(reference, str):
        return None
    try:
        _resolve(reference)
    except ImportError as err:
        cause = err.__cause__ or err
        return (f"downstream task {task} skipped: its code needs a package that is not installed ({cause}); "
                "install it (RULER's tasks: pip install wonderwords 'nltk>=3.9.1') and run again")
    return None


def _function_name(reference) -> str:
    return str(reference).rsplit(".", 1)[-1]


def _resolve(reference: str):
    """The object a ``!function`` reference names (lm-eval's own resolver: a path to a module file)."""
    from lm_eval.tasks._yaml_loader import _import_fun_from_str  # lazy: lm-eval (the eval extra) takes seconds to import

    return _import_fun_from_str(reference)


def _spec_from_config(cfg: dict, yaml_path: Path | None) -> DatasetSpec:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or ()
    if isinstance(files, dict):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    elif isinstance(files, str):
        files = [files]
    base = yaml_path.parent if yaml_path else Path.cwd()
    files = tuple(str(f if Path(f).is_absolute() else base / f) for f in files)
    return DatasetSpec(str(cfg.get("dataset_path")), cfg.get("dataset_name"), files)
