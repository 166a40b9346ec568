"""The reproducibility record every run writes: config, code version, packages, seeds, device."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: the section configs' packages import this module
    from dofla.config import RunConfig

PACKAGES = ("dofla", "torch", "transformers", "hydra-core", "omegaconf", "datasets", "lm-eval", "wandb")


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    """The current git SHA and whether the work tree has uncommitted changes (None outside git)."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return {"sha": sha, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_record(cfg: RunConfig, overrides: list[str]) -> dict[str, Any]:
    return {
        "config": asdict(cfg),
        "overrides": list(overrides),
        "git": git_state(),
        "packages": package_versions(),
        "seed": cfg.seed,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def write_json(path: Path, payload: Any) -> None:
    """Write JSON atomically (temp file + rename), so a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    """The parsed file, or None when it is missing or unreadable (then the stage reruns)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
