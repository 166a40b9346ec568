"""Verified run artifacts: written atomically, each recording the settings that produced it.

A layer artifact that is truncated, corrupted, or was written for other settings (another feature
map, dimension, loss or activation cache) is reported in one sentence and treated as missing, so
the stage rebuilds it. Nothing here deletes a file written for other settings: it may belong to
another run sharing the directory, so a stage writes its own into a directory of its settings
(:func:`settings_digest`). The one exception is a run's own model directory (``student/``), which
:func:`save_model_dir` replaces when that run's settings changed.

Checkpoints and layer artifacts hold tensors and plain values only and load with
``torch.load(weights_only=True)``: a file in a shared directory is never code that runs here, and one
that would need more is refused in one sentence and rebuilt (an artifact) or started over (a checkpoint).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dofla.errors import DoflaError
from dofla.record import read_json, write_json

logger = logging.getLogger(__name__)

SETTINGS_FILE = "dofla_settings.json"  # beside a model directory's config.json


class ArtifactError(DoflaError, RuntimeError):
    """An artifact a stage needs is missing or unusable; the message says how to produce it."""


def canonical(settings: Any) -> Any:
    """``settings`` as it reads back from JSON (tuples -> lists, keys sorted), for comparisons."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def settings_digest(settings: dict) -> str:
    """12 hex digits naming ``settings`` (e.g. the subdirectory of a shared layer directory)."""
    return hashlib.sha256(json.dumps(canonical(settings), sort_keys=True).encode()).hexdigest()[:12]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks (caches can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# what torch.load(weights_only=True) rebuilds, and all a checkpoint or artifact may hold: a file in a
# shared directory (paths.cache_dir, train.layer_dir) that someone else can write must not be code
# that runs here. Exact types: a subclass (a numpy float, a named tuple) would be pickled by class.
PLAIN_TYPES = (dict, OrderedDict, list, tuple, str, int, float, bool, type(None), torch.Size, torch.dtype,
               torch.device, torch.Tensor, torch.nn.Parameter)


def plain_problem(value: Any, where: str = "payload") -> str | None:
    """None when ``value`` is tensors and plain values alone; else the first key path that is not."""
    if type(value) not in PLAIN_TYPES:
        return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, dict):
        for key, item in value.items():
            problem = plain_problem(key, f"a key of {where}") or plain_problem(item, f"{where}[{key!r}]")
            if problem is not None:
                return problem
    elif type(value) in (list, tuple):  # not torch.Size: its items are ints
        for i, item in enumerate(value):
            problem = plain_problem(item, f"{where}[{i}]")
            if problem is not None:
                return problem
    return None


def load_plain(path: Path) -> Any:
    """torch.load of tensors and plain values only (weights_only=True): a file that needs more raises
    pickle.UnpicklingError before anything in it runs. Mapped to the CPU: GPU-written files load anywhere."""
    return torch.load(path, weights_only=True, map_location="cpu")


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the filesystem can sync a directory at all)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform that cannot open a directory (Windows) has nothing to sync here
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # filesystems without directory sync
            raise
    finally:
        os.close(fd)


def torch_save_atomic(payload: Any, path: Path) -> None:
    """torch.save to a temporary name, fsync it, rename, fsync the directory: neither a kill nor a node
    crash leaves half a file (or an empty one) under ``path``. The payload must load with
    :func:`load_plain` (tensors and plain values: :func:`plain_problem`)."""
    path = Path(path)
    problem = plain_problem(payload)
    if problem is not None:
        raise TypeError(f"{path}: {problem}; a checkpoint or artifact holds tensors and plain values only, "
                        "so that it loads without unpickling code")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


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
        return "its checksum record is missing (an interrupted write)" if path.exists() else "it is missing"
    if not path.exists() or path.stat().st_size != record["size"]:
        return "it is missing or truncated"
    if file_sha256(path) != record["sha256"]:
        return "it is corrupted (checksum mismatch)"
    if record["meta"] != canonical(meta):
        return "it was written for other settings (foreign artifact)"
    return None


def load_artifact(path: Path, meta: dict, quiet: bool = False) -> dict[str, Any] | None:
    """The payload if the artifact verifies, else None (after saying why, if it existed).

    Never deletes: the caller writes a fresh artifact of its own settings in its place.
    """
    path = Path(path)
    if not path.exists() and not _sidecar(path).exists():
        return None
    problem = artifact_problem(path, meta)
    if problem is not None:
        if not quiet:
            logger.warning(f"dofla: artifact {path} is not usable ({problem}); rebuilding it")
        return None
    try:
        return load_plain(path)
    except pickle.UnpicklingError:
        logger.warning(f"dofla: refusing artifact {path}: it holds more than tensors and plain values (not "
                       "written by this dofla), and unpickling it could run code; rebuilding it")
        return None


def load_checkpoint(path: Path | None, meta: dict | None, normalize=None) -> dict[str, Any] | None:
    """A training checkpoint written with ``meta`` (both compared through ``normalize``), else None
    (one line when one was ignored)."""
    if path is None or not Path(path).exists():
        return None
    try:
        ckpt = load_plain(path)
    except pickle.UnpicklingError:
        logger.warning(f"dofla: refusing checkpoint {path}: it holds more than tensors and plain values (damaged, "
                       "or not written by this dofla), and unpickling it could run code; starting over")
        return None
    except Exception as err:  # a damaged checkpoint only costs the steps since the last one
        logger.warning(f"dofla: checkpoint {path} is unreadable ({type(err).__name__}); starting over")
        return None
    normalize = normalize or (lambda m: m)
    if not isinstance(ckpt, dict) or canonical(normalize(ckpt.get("meta"))) != canonical(normalize(meta)):
        logger.warning(f"dofla: checkpoint {path} was written for other settings; ignoring it")
        return None
    return ckpt


def model_dir_matches(target: Path, settings: dict) -> bool:
    """True when the model directory ``target`` is complete and was saved for ``settings``."""
    target = Path(target)
    return (target / "config.json").exists() and read_json(target / SETTINGS_FILE) == canonical(settings)


def save_model_dir(model, tokenizer, target: Path, settings: dict) -> None:
    """Hugging Face model + tokenizer + ``dofla_settings.json``, replacing ``target`` atomically.

    ``target`` is this run's own directory (``student/``): an older one of other settings is
    replaced, never kept half-overwritten.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.tmp"))
    old = target.with_name(f"{target.name}.old-{tmp.name[-8:]}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / SETTINGS_FILE, canonical(settings))
        if target.exists():  # os.replace cannot replace a non-empty directory
            os.replace(target, old)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
