"""Verified run artifacts: written atomically, with a sidecar recording size, checksum and meta.

A layer artifact that is truncated, corrupted, or was written for other settings (another feature
map, dimension, loss or activation cache) is reported in one sentence and treated as missing, so
the stage rebuilds it instead of using it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dofla.record import write_json


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks (caches can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def torch_save_atomic(payload: Any, path: Path) -> None:
    """torch.save to a temporary name, then rename: a kill never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, path)


def save_artifact(path: Path, payload: dict, meta: dict) -> None:
    """Save ``payload`` atomically, then its sidecar (size, sha256, meta)."""
    path = Path(path)
    torch_save_atomic({**payload, "meta": meta}, path)
    record = {"size": path.stat().st_size, "sha256": file_sha256(path), "meta": meta}
    write_json(_sidecar(path), record)


def artifact_problem(path: Path, meta: dict) -> str | None:
    """None when ``path`` is intact and was written with ``meta``; else what is wrong."""
    path = Path(path)
    try:
        record = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return "its checksum record is missing (an interrupted write)"
    if not path.exists() or path.stat().st_size != record["size"]:
        return "it is missing or truncated"
    if file_sha256(path) != record["sha256"]:
        return "it is corrupted (checksum mismatch)"
    if record["meta"] != json.loads(json.dumps(meta, sort_keys=True, default=str)):
        return "it was written for other settings (foreign artifact)"
    return None


def load_artifact(path: Path, meta: dict) -> dict[str, Any] | None:
    """The payload if the artifact verifies, else None (after saying why, if it existed)."""
    path = Path(path)
    if not path.exists() and not _sidecar(path).exists():
        return None
    problem = artifact_problem(path, meta)
    if problem is not None:
        print(f"dofla: artifact {path} is not usable ({problem}); rebuilding it", flush=True)
        path.unlink(missing_ok=True)
        _sidecar(path).unlink(missing_ok=True)
        return None
    return torch.load(path, weights_only=False)
