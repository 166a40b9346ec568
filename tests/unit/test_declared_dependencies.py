"""What dofla imports is what pyproject.toml declares: every third-party module imported anywhere in
src/dofla (at module level or inside a function) belongs to a distribution named in the core
dependencies or in an extra."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# modules of optional packages this machine does not install (the fla extra: CUDA only)
NOT_INSTALLED_HERE = {"fla": ["flash-linear-attention"]}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def declared() -> dict[str, str]:
    """distribution -> where it is declared ("core" or the extra's name)."""
    out = {_name(r): "core" for r in PYPROJECT["dependencies"]}
    for extra, requirements in PYPROJECT["optional-dependencies"].items():
        for r in requirements:
            out.setdefault(_name(r), extra)
    return out


def imported_top_level() -> dict[str, str]:
    """top-level module -> one file of src/dofla that imports it (third-party ones and the stdlib)."""
    found = {}
    for path in sorted((ROOT / "src" / "dofla").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                found.setdefault(name.partition(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    owners = {**NOT_INSTALLED_HERE, **packages_distributions()}
    declared_names = declared()
    missing = {}
    for module, where in imported_top_level().items():
        if module in sys.stdlib_module_names or module in ("dofla", "__future__"):
            continue
        dists = {_name(d) for d in owners.get(module, [module])}
        if not dists & declared_names.keys():
            missing[module] = (sorted(dists), where)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_floors_the_code_needs():
    requirements = {_name(r): r for extra in PYPROJECT["optional-dependencies"].values() for r in extra}
    # lm_eval.tasks._index and _yaml_loader (dofla.eval.downstream) first exist in 0.4.12;
    # wandb.init(reinit="finish_previous") (dofla.tracking) in 0.19.10
    assert ">=0.4.12" in requirements["lm-eval"] and ">=0.19.10" in requirements["wandb"]


def test_the_lock_pins_every_declared_package_the_default_install_uses():
    """make install: the core and the Makefile's extras at the lock's versions (torch is installed first,
    outside the lock; the fla extra is CUDA only)."""
    extras = re.search(r"^EXTRAS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split(",")
    wanted = {_name(r) for r in PYPROJECT["dependencies"]}
    wanted |= {_name(r) for extra in extras for r in PYPROJECT["optional-dependencies"][extra]}
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    locked = {_name(line) for line in lines if line.strip() and not line.startswith("#")}
    assert wanted - {"torch"} <= locked, f"declared but not in requirements.lock: {sorted(wanted - {'torch'} - locked)}"
