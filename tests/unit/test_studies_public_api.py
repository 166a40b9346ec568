"""The studies (studies/) use dofla's public API only: what ``dofla`` and its packages export in
``__all__``, plus the typed config and ``dofla.pipeline``. A study reaching into a module's
internals breaks silently when they move; this keeps them honest."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

STUDIES = sorted((Path(__file__).resolve().parents[2] / "studies").glob("*.py"))
# public modules: any name without a leading underscore (the typed config, the pipeline, and the paper
# sweeps' shape that dofla-gpucheck and the cost studies share: cells, the teacher's grid, epochs)
MODULES = ("dofla.config", "dofla.pipeline", "dofla.gpucheck_cells")


def dofla_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from dofla... import name`` and (module, "") of ``import dofla...``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dofla":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "dofla"]
    return found


def is_public(module: str, name: str) -> bool:
    if module in MODULES:
        return bool(name) and not name.startswith("_")
    imported = importlib.import_module(module)
    is_package = hasattr(imported, "__path__")
    return is_package and name in getattr(imported, "__all__", ())


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_a_study_imports_only_the_public_api(path):
    private = [f"{module}:{name}" for module, name in dofla_imports(path) if not is_public(module, name)]
    assert not private, f"{path.name} imports internals: {private}; export them from the package's __all__"


def test_the_check_tells_internals_from_exports():
    assert is_public("dofla.cache", "pooled_activations") and is_public("dofla.config", "RunConfig")
    assert not is_public("dofla.cache.store", "pooled_activations")  # a module, not a package export
    assert not is_public("dofla.stages.data", "load_data") and not is_public("dofla.train", "shifted_features")
    assert len(STUDIES) >= 4
