"""The reproducibility record every run writes: config, code version (and what differs from it),
packages, seeds, the machine's numeric fingerprint, the teacher."""
from __future__ import annotations

import hashlib
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


# Changes that cannot change a run: the documentation, the results pages and the run records a reproduction
# script commits as it goes (everything under docs/, every Markdown file); as git pathspecs for `git diff`.
NOT_CODE = (":(top,exclude)docs", ":(top,exclude,glob)**/*.md")


def is_code(path: str) -> bool:
    return not (path.startswith("docs/") or path.endswith(".md"))


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    """The current git SHA and whether the work tree differs from it in what can change a run: ``dirty``,
    the ``changed`` paths (``git status --porcelain``: tracked changes and untracked files git does not ignore;
    a change under ``docs/`` or to a Markdown file is listed but does not make the tree dirty) and a hash of
    ``git diff HEAD`` of those paths (two dirty records with equal hashes ran the same tracked code). None
    outside git."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                                  check=True).stdout

        sha = git("rev-parse", "HEAD").strip()
        changed = sorted(line[3:] for line in git("status", "--porcelain").splitlines() if line.strip())
        code = any(is_code(path) for path in changed)  # porcelain paths are the repository root's
        diff = hashlib.sha256(git("diff", "HEAD", "--", ":(top)", *NOT_CODE).encode()).hexdigest()[:16] if code else None
        return {"sha": sha, "dirty": code, "changed": changed, "diff_sha256": diff}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None, "changed": None, "diff_sha256": None}


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_build() -> dict[str, Any]:
    """What decides how the same seed rounds on this machine: torch's version, its BLAS and oneDNN
    builds, the CPU kernels it dispatches to, the CPU and the intra-op thread count (a reduction split
    over more threads sums in another order)."""
    shown = torch.__config__.show()
    settings = dict(item.strip().split("=", 1) for item in shown.split("Build settings:", 1)[-1].split(",")
                    if "=" in item)
    lines = [line.strip(" -") for line in shown.splitlines()]
    return {"torch": torch.__version__, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "blas": settings.get("BLAS_INFO"), "lapack": settings.get("LAPACK_INFO"),
            "blas_build": next((line for line in lines if "Math Kernel Library" in line or "OpenBLAS" in line), None),
            "onednn_build": next((line for line in lines if "MKL-DNN" in line or "oneDNN" in line), None),
            "mkldnn": torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled),
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_record(cfg: RunConfig, overrides: list[str], teacher: dict | None = None) -> dict[str, Any]:
    """run.json's reproducibility part. A run from a dirty tree is marked (``git.dirty``, ``git.changed``),
    not refused: tests, sweeps in progress and local experiments run from dirty trees, and the record
    names what differed; whoever collects records for a results page can refuse the dirty ones.
    ``teacher``: what the teacher is (:func:`dofla.models.loading.teacher_identity`), given by the caller
    because the models package sits above this module."""
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
        "fingerprint": torch_build(),
        "teacher": teacher or {"source": cfg.model.source, "revision": cfg.model.revision},
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
