"""A built wheel, installed outside the checkout, composes the same configs as the checkout.

The wheel is built from a copy of the sources (so no build/ lands in the repository), installed with
``pip install --target`` into a temporary directory, and run from another temporary directory with
only that directory on PYTHONPATH: the checkout's src/ must not be what gets imported.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(pythonpath: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def _run(args: list[str], cwd: Path, pythonpath: Path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(pythonpath), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """{"wheel": the built wheel, "site": where it is installed, "cwd": a directory outside the repo}."""
    tmp = tmp_path_factory.mktemp("install")
    tree = tmp / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in ("src", "conf"):
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(tree)],
                   check=True, capture_output=True, timeout=180)
    wheel = next((tmp / "dist").glob("dofla-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=180)
    (tmp / "elsewhere").mkdir()
    return {"wheel": wheel, "site": tmp / "site", "cwd": tmp / "elsewhere"}


def test_installed_package_is_imported_not_the_checkout(installed):
    out = _run(["-c", "import dofla.cli; print(dofla.cli.__file__); print(dofla.cli.CONF_DIR)"],
               installed["cwd"], installed["site"])
    module, conf = (Path(line) for line in out.split())
    assert module.is_relative_to(installed["site"])
    assert conf == installed["site"] / "dofla" / "conf"


def test_installed_dofla_composes_the_checkouts_config(installed):
    for overrides in ([], ["allocation=fix", "data=text_files", "feature_map=performer", "experiment=smoke_tiny"]):
        got = _run(["-m", "dofla", "--cfg", "job", *overrides], installed["cwd"], installed["site"])
        want = _run(["-m", "dofla", "--cfg", "job", *overrides], installed["cwd"], ROOT / "src")
        assert got == want and "feature_map:" in got


def test_installed_help_lists_the_config_groups(installed):
    out = _run(["-m", "dofla", "--help"], installed["cwd"], installed["site"])
    assert "allocation: budget, dof, dof_clip" in out and "powered by Hydra" not in out.splitlines()[0]


def test_every_config_directory_is_a_declared_package():
    """setuptools packs a directory of data files only as a declared package (an undeclared one is
    packed with a deprecation warning today, and not at all once the warning's grace period ends)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    directories = {"dofla.conf" + "".join("." + part for part in d.relative_to(ROOT / "conf").parts)
                   for d in [ROOT / "conf", *(ROOT / "conf").rglob("*")] if d.is_dir() and d.name != "__pycache__"}
    missing = sorted(directories - declared)
    assert not missing, f"add these config directories to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_wheel_holds_every_package_and_config_file(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    packages = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("__init__.py")}
    missing = sorted(p for p in packages if p not in names)
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    configs = {"dofla/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert configs and configs <= names
