"""Where the eval stage keeps its measurements: one store per run, and one per teacher shared by runs.

A measurement is a dict of metrics computed under some settings. Its scalar metrics go to
``eval_measurements.json`` (``{name-digest: {"settings", "metrics", "skipped"}}``), from which
``metrics.json`` is written; its per-sequence or per-prompt values (keys starting with ``seq/``: lists,
one number per held-out sequence or passkey prompt) go to ``eval_sequences.json`` under the same key.
The sequences are what a run record keeps so that intervals can count the held-out text
(:mod:`dofla.report.intervals`).

A measurement that only reads the teacher (its perplexity, loss by position and passkey on the same
tokens) is the same in every run of a sweep: with a shared store (``<cache>/teacher_scores``) the first
run computes it and the others copy it, under a file lock.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from dofla import distributed
from dofla.artifacts import canonical, settings_digest
from dofla.record import read_json, write_json
from dofla.run_files import MEASUREMENTS  # noqa: F401 - API: the file the measurements are kept in

SEQUENCES = "eval_sequences.json"
PER_SEQUENCE = "seq/"


def model_settings(model) -> dict:
    """What names a model in a measurement's key: the settings it was built from (``dofla_settings``,
    attached by the assemble and fine-tune stages), else a fingerprint of its weights (a model handed
    in from Python)."""
    settings = getattr(model, "dofla_settings", None)
    if settings is not None:
        return {"settings": settings}
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):  # raw bytes: any dtype, bf16 included
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"weights": digest.hexdigest()}


def tokens_digest(tokens) -> str:
    """SHA-256 of a (S, L) token tensor, shape included."""
    return hashlib.sha256(json.dumps(list(tokens.shape)).encode() + tokens.cpu().numpy().tobytes()).hexdigest()


def split_sequences(metrics: dict) -> tuple[dict, dict]:
    """(scalar metrics, per-sequence lists) of a computed measurement."""
    scalars = {k: v for k, v in metrics.items() if not k.startswith(PER_SEQUENCE)}
    return scalars, {k: v for k, v in metrics.items() if k.startswith(PER_SEQUENCE)}


class Measurements:
    """One directory's stores. Under torchrun every rank holds rank 0's copy, so all ranks agree on
    what to compute; only rank 0 writes."""

    def __init__(self, path: Path, main: bool, shared: Path | None = None):
        self.path, self.main, self.shared = Path(path), main, shared
        self.sequences_path = self.path.with_name(SEQUENCES)
        loaded = ((read_json(self.path) or {}), (read_json(self.sequences_path) or {})) if main else None
        self.entries, self.sequences = distributed.broadcast(loaded)

    def get(self, name: str, settings: dict, compute: Callable[[], dict], plan=None, share: bool = False) -> dict:
        """The scalar metrics of ``name`` taken with ``settings``: stored ones, or ``compute()`` (saved at
        once). A stored measurement without its per-sequence values (taken before they were kept) is
        taken again. ``plan``: its ``skipped`` reasons are kept and restored on reuse. ``share``: look
        in, and add to, the shared store first (a teacher-only measurement)."""
        key, settings = f"{name}-{settings_digest(settings)}", canonical(settings)
        entry = self.entries.get(key)
        if entry is None or entry["settings"] != settings or key not in self.sequences:
            found = distributed.broadcast(self._shared(key, settings) if self.main and share and self.shared else None)
            entry, sequences = found if found is not None else self._compute(compute, settings, plan)
            self.entries[key], self.sequences[key] = entry, sequences
            if self.main:
                write_json(self.sequences_path, self.sequences)
                write_json(self.path, self.entries)
                if share and self.shared and found is None:
                    self._share(key, entry, sequences)
        if plan is not None:
            plan.skipped.update(entry["skipped"])
        return dict(entry["metrics"])

    def per_sequence(self, metrics: dict | None = None) -> dict:
        """Every stored measurement's per-sequence lists, by metric name (``seq/`` keys). With ``metrics``
        (the run's metrics.json), only the measurements whose scalar metrics are all the ones it holds: a
        directory scored more than once (the dev and then the test split, or other eval settings) keeps
        every scoring's entries, stored in key order, and only the last scoring's are what metrics.json says."""
        keys = [key for key, entry in self.entries.items()
                if metrics is None or all(metrics.get(k) == v for k, v in entry["metrics"].items())]
        found: dict = {}
        for key in keys:
            for name, values in self.sequences.get(key, {}).items():
                if name in found and found[name] != values:
                    raise ValueError(f"{self.path.parent} holds two measurements of {name} that its metrics.json "
                                     "cannot tell apart; evaluate the run again into a fresh directory")
                found[name] = values
        return found

    @staticmethod
    def _compute(compute: Callable[[], dict], settings: dict, plan) -> tuple[dict, dict]:
        before = dict(plan.skipped) if plan is not None else {}
        metrics, sequences = split_sequences(compute())
        skipped = {k: v for k, v in plan.skipped.items() if k not in before} if plan is not None else {}
        return {"settings": settings, "metrics": metrics, "skipped": skipped}, sequences

    def _shared(self, key: str, settings: dict) -> tuple[dict, dict] | None:
        """(entry, sequences) of ``key`` in the shared store, when taken with the same settings."""
        with FileLock(str(self.shared / f"{MEASUREMENTS}.lock")):
            entry = (read_json(self.shared / MEASUREMENTS) or {}).get(key)
            sequences = (read_json(self.shared / SEQUENCES) or {}).get(key)
        if entry is None or entry["settings"] != settings or sequences is None:
            return None
        return entry, sequences

    def _share(self, key: str, entry: dict, sequences: dict) -> None:
        self.shared.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.shared / f"{MEASUREMENTS}.lock")):
            for name, value in ((MEASUREMENTS, entry), (SEQUENCES, sequences)):
                stored = read_json(self.shared / name) or {}
                stored[key] = value
                write_json(self.shared / name, stored)
