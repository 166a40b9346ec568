"""Run records: the few small files of a finished run that its results are computed from.

A record is a directory holding the run's ``run.json`` (resolved config, git SHA, package versions,
seed, cache key), ``metrics.json``, ``sequences.json`` (every per-sequence and per-prompt value the
eval stage kept: held-out loss per sequence, loss by position per sequence, passkey recall and answer
NLL per prompt), ``allocation.json`` (each layer's feature dims, and its DoF where Algorithm 1 ran),
``dof.json`` where the dof stage ran (each layer's and each head's DoF and the estimator's settings),
``plan.json`` where the plan was given whole (``attention.plan``: the plan the file held, not its path) and,
when the run distilled, ``distill.json`` (the KL curve and the tokens). No
weights: a record is tens of KB, so the records behind a results page live in the repository and
the page's tables are recomputed from them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dofla.eval.store import MEASUREMENTS, Measurements
from dofla.models.plan import read_plan
from dofla.record import read_json, write_json

SIGNIFICANT = 7  # digits kept of each per-sequence value: far below any difference a table shows


@dataclass(frozen=True)
class RunRecord:
    """One run's record, loaded."""

    name: str
    config: dict
    metrics: dict
    sequences: dict  # metric name (without the ``seq/`` prefix) -> list of numbers
    allocation: dict | None = None  # allocation.json: ``dims`` per layer, ``layer_dof``, ``policy``, ``budget``
    dof: dict | None = None  # dof.json: ``layer_dof``, ``per_head`` (per layer, per query head), ``settings``
    threads: int | None = None  # run.json's: torch's intra-op threads in the run
    plan: list | None = None  # plan.json: the plan given whole (attention.plan), a list of layers of head dicts

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    @property
    def experiment(self) -> str | None:
        return self.config.get("experiment")


def _rounded(values: list) -> list:
    return [float(f"{v:.{SIGNIFICANT}g}") if isinstance(v, float) else v for v in values]


def collect_record(run_dir: Path, into: Path) -> Path:
    """Write the record of the finished run in ``run_dir`` to ``into/<run_dir's name>/``; returns it."""
    run_dir = Path(run_dir)
    run, metrics = read_json(run_dir / "run.json"), read_json(run_dir / "metrics.json")
    if run is None or metrics is None:
        raise FileNotFoundError(f"{run_dir} has no run.json or metrics.json: run it to the end (eval) first")
    sequences = Measurements(run_dir / MEASUREMENTS, main=True).per_sequence(metrics)
    target = Path(into) / run_dir.name
    write_json(target / "run.json", {k: v for k, v in run.items() if k != "host"})
    write_json(target / "metrics.json", metrics)
    write_json(target / "sequences.json", {k.removeprefix("seq/"): _rounded(v) for k, v in sorted(sequences.items())})
    allocation = read_json(run_dir / "allocation.json")
    if allocation is not None:
        write_json(target / "allocation.json", allocation)
    dof = _dof(run_dir)
    if dof is not None:
        write_json(target / "dof.json", dof)
    plan = _given_plan(run["config"])
    if plan is not None:
        write_json(target / "plan.json", plan)
    distilled = read_json(run_dir / "distill_summary.json")
    if distilled is not None:
        write_json(target / "distill.json", {"tokens": distilled["tokens"], "curve": distilled["curve"]})
    return target


def _dof(run_dir: Path) -> dict | None:
    """What a record keeps of a run's dof.json: the DoF per layer and per head and the settings (not the
    J-samples)."""
    dof = read_json(run_dir / "dof.json")
    return None if dof is None else {k: dof[k] for k in ("layer_dof", "per_head", "settings") if k in dof}


def _given_plan(config: dict) -> list | None:
    """The plan a run was given whole (``attention.plan``), read from its file; None without one."""
    path = config.get("attention", {}).get("plan")
    if not path:
        return None
    if not Path(path).is_file():
        raise FileNotFoundError(f"the run's plan file {path} (attention.plan) is gone; put it back before "
                                "keeping the record, which holds the plan itself")
    return read_plan(path).to_list()


def collect_allocation_record(run_dir: Path, into: Path) -> Path:
    """The record of a run that stopped after the allocate stage (``stages=[cache,allocate]``): its
    run.json and allocation.json, nothing measured; returns it."""
    run_dir = Path(run_dir)
    run, allocation = read_json(run_dir / "run.json"), read_json(run_dir / "allocation.json")
    if run is None or allocation is None:
        raise FileNotFoundError(f"{run_dir} has no run.json or allocation.json: run its allocate stage first")
    target = Path(into) / run_dir.name
    write_json(target / "run.json", {k: v for k, v in run.items() if k != "host"})
    write_json(target / "allocation.json", allocation)
    return target


def load_record(directory: Path) -> RunRecord:
    """The record in ``directory`` (see :func:`collect_record`; an allocation-only record has no metrics
    and no per-sequence values)."""
    directory = Path(directory)
    run = json.loads((directory / "run.json").read_text())
    metrics, sequences = read_json(directory / "metrics.json"), read_json(directory / "sequences.json")
    return RunRecord(directory.name, run["config"], {} if metrics is None else metrics,
                     {} if sequences is None else sequences, read_json(directory / "allocation.json"),
                     read_json(directory / "dof.json"), run.get("threads"), read_json(directory / "plan.json"))


def load_records(root: Path) -> list[RunRecord]:
    """Every record directly under ``root``, by name."""
    return [load_record(d) for d in sorted(Path(root).iterdir()) if (d / "run.json").is_file()]


def run_record(run_dir: Path) -> RunRecord:
    """A finished run directory read as its record would be (without writing one)."""
    run_dir = Path(run_dir)
    metrics = read_json(run_dir / "metrics.json")
    sequences = Measurements(run_dir / MEASUREMENTS, main=True).per_sequence(metrics)
    run = read_json(run_dir / "run.json")
    return RunRecord(run_dir.name, run["config"], metrics,
                     {k.removeprefix("seq/"): v for k, v in sequences.items()}, read_json(run_dir / "allocation.json"),
                     _dof(run_dir), run.get("threads"), _given_plan(run["config"]))


def read_runs(paths: list[Path]) -> list[RunRecord]:
    """Every run record and finished run directory at or below ``paths``."""
    found = []
    for path in map(Path, paths):
        for run in sorted(p.parent for p in [path / "run.json", *path.rglob("*/run.json")] if p.is_file()):
            if (run / "sequences.json").is_file():
                found.append(load_record(run))
            elif (run / "metrics.json").is_file():
                found.append(run_record(run))
    return found
