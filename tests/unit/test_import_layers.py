"""The house's import rules, read from every import statement, those inside functions included:
libraries know nothing of runs (no import of the stages, the pipeline or the CLI), no stage imports
another stage, the modules form no circle, and, a package at a time, every import runs down the floors
(:data:`FLOORS`) and the packages form no circle either."""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
RUN_LEVEL = ("dofla.stages", "dofla.pipeline", "dofla.cli", "dofla.evaluate_saved")
LIBRARIES = ("dofla.attention", "dofla.feature_maps", "dofla.dof", "dofla.train", "dofla.eval", "dofla.models",
             "dofla.cache", "dofla.data", "dofla.report")
# modules of dofla.stages that are not stages: what every stage shares
STAGE_HELPERS = ("dofla.stages", "dofla.stages.plan", "dofla.stages.context", "dofla.stages.keys",
                 "dofla.stages.results", "dofla.stages.sources", "dofla.stages.students", "dofla.stages.softmax_layers",
                 "dofla.stages.parallel")
# Circles and stage-to-stage imports in modules whose owners change them next, each with the edit that
# ends it; the tests fail when one ends (delete it here) as when a new one starts.
PENDING_CIRCLES: set[frozenset[str]] = set()
PENDING_STAGE_IMPORTS: set[str] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "dofla").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


@functools.cache
def reexports(package: str) -> dict[str, str]:
    """name -> the submodule a package's ``__init__`` imports it from."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    return {alias.asname or alias.name: node.module for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + ".")
            for alias in node.names}


def resolve(target: str) -> str | None:
    """The module an imported name lives in: ``dofla.models.convert`` -> ``dofla.models.student``."""
    if target in MODULES:
        return target
    package, _, name = target.rpartition(".")
    if name in reexports(package):
        return resolve(reexports(package)[name])
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def imports(path: Path) -> set[str]:
    """The dofla modules ``path`` imports, at module level or inside any function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dofla"):
            out.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(resolve(a.name) for a in node.names if a.name.startswith("dofla"))
    return out - {None}


@functools.cache
def graph() -> dict[str, set[str]]:
    return {name: imports(path) - {name} for name, path in MODULES.items()}


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def stage_of(name: str) -> str | None:
    """The stage a module belongs to (``dofla.stages.train.direct`` -> ``dofla.stages.train``)."""
    if not within(name, ("dofla.stages",)) or name in STAGE_HELPERS:
        return None
    return ".".join(name.split(".")[:3])


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_libraries_import_nothing_of_a_run():
    upward = {f"{name} -> {target}" for name, targets in graph().items() if within(name, LIBRARIES)
              for target in targets if within(target, RUN_LEVEL)}
    assert not upward, sorted(upward)


def test_no_stage_imports_another_stage():
    crossing = {f"{name} -> {stage_of(target)}" for name, targets in graph().items() if stage_of(name)
                for target in targets if stage_of(target) not in (None, stage_of(name))}
    assert crossing == PENDING_STAGE_IMPORTS, sorted(crossing ^ PENDING_STAGE_IMPORTS)


def test_imports_form_no_circle_even_inside_functions():
    found = set(circles(graph()))
    assert found == PENDING_CIRCLES, [sorted(c) for c in found ^ PENDING_CIRCLES]


def test_the_graph_sees_a_circle_closed_inside_a_function(tmp_path):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [frozenset({"a", "b", "c"})]
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from dofla.models import convert\n")
    assert imports(module) == {"dofla.models.student"}  # resolved through the package's re-export


# What may be imported inside a function: optional extras and libraries that take seconds to import,
# kept off the start of every run; each such import says why in a ``# lazy:`` comment.
LAZY = ("lm_eval", "datasets", "pyarrow", "matplotlib", "wandb", "peft", "fla")


def function_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, commented) of every import inside a function of ``path``."""
    lines = path.read_text().splitlines()
    found = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    said = "# lazy:" in lines[node.end_lineno - 1] or "# lazy:" in lines[node.lineno - 2]
                    found.append((node.lineno, module or "", said))
    return found


def test_imports_inside_functions_are_only_lazy_extras_and_say_why():
    wrong = [f"{path.relative_to(SRC)}:{line} {module}" for path in MODULES.values()
             for line, module, said in function_imports(path) if module.split(".")[0] not in LAZY or not said]
    assert not wrong, wrong


def test_the_lazy_import_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import wandb  # lazy: optional\n\n\ndef g():\n    from dofla import errors\n")
    assert function_imports(module) == [(2, "wandb", True), (6, "dofla", False)]


# Imports each module named on its command line first, in a forked child of an interpreter that holds
# torch and transformers (so each child pays only dofla's own imports); prints the ones that fail.
FIRST_IMPORTS = """
import importlib, os, sys
import torch, transformers.modeling_utils
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException as error:
            print(name, type(error).__name__, error)
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.long
def test_every_module_imports_first_in_a_fresh_interpreter():
    """A circle the static graph allows (a package's ``__init__`` run half-way, e.g. a section config's
    package importing back into ``dofla.config``) breaks only when its module is the first one imported."""
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, *sorted(MODULES)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout[-3000:] + done.stderr[-2000:]


# The floors, lowest first: a package imports only from its own floor or below. A package is
# ``dofla.<name>`` (a subpackage or a top-level module), ``dofla`` its public face; each section's
# config dataclass (``dofla.<package>.config``, composed by ``dofla.config``) sits on the config floor,
# not with its package, since every floor reads the run's config.
SECTION_CONFIGS = tuple(f"dofla.{name}.config" for name in ("attention", "data", "dof", "eval", "feature_maps",
                                                            "models", "train"))
FLOORS = (
    # what everything uses: errors, the registry, devices and precision, small value checks, logging, file names
    ("dofla.errors", "dofla.faults", "dofla.hub", "dofla.measure", "dofla.precision", "dofla.runtime",
     "dofla.registry", "dofla.distributed", "dofla.options", "dofla.value_checks", "dofla.logs", "dofla.run_files"),
    ("dofla.config",),  # dofla.section_keys and the section configs, composed into RunConfig
    ("dofla.record", "dofla.artifacts"),  # JSON records and keyed artifacts on disk
    ("dofla.attention", "dofla.data"),  # kernels; text and tokens
    ("dofla.feature_maps",),
    ("dofla.models", "dofla"),  # students built from teachers; the package's public face re-exports them
    ("dofla.train",),  # trainers and their steps
    ("dofla.eval",),  # measurements, lm-eval tasks and the fine-tune protocol (which trains)
    ("dofla.dof", "dofla.cache", "dofla.report", "dofla.tracking", "dofla.gpucheck_cells"),  # read eval and train
    ("dofla.stages",),  # a run's stages
    ("dofla.validate", "dofla.validate_training", "dofla.world", "dofla.gpucheck"),  # checks of a run's plan
    ("dofla.evaluate_saved", "dofla.pipeline"),
    ("dofla.cli", "dofla.__main__"),
)
# Upward imports in modules whose owners change them next, each with the edit that ends it; the test
# fails when one ends (delete it here) as when a new one starts.
PENDING_UPWARD: set[str] = set()


def package_of(module: str) -> str:
    """``dofla.eval.metrics`` -> ``dofla.eval``; a section config -> ``dofla.config``; ``dofla`` -> itself."""
    if module in SECTION_CONFIGS or module == "dofla.section_keys":
        return "dofla.config"
    return ".".join(module.split(".")[:2])


def floor_of(package: str) -> int:
    found = [i for i, floor in enumerate(FLOORS) if package in floor]
    assert len(found) == 1, f"{package} must be on exactly one floor of FLOORS, not {len(found)}"
    return found[0]


def upward(edges: dict[str, set[str]]) -> set[str]:
    """Every module import ``a -> b`` whose package sits on a higher floor than ``a``'s."""
    return {f"{name} -> {target}" for name, targets in edges.items() for target in targets
            if floor_of(package_of(target)) > floor_of(package_of(name))}


def package_graph(edges: dict[str, set[str]], leave_out: set[str] = frozenset()) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (less the module imports in ``leave_out``)."""
    out: dict[str, set[str]] = {package_of(name): set() for name in edges}
    for name, targets in edges.items():
        for target in targets:
            if f"{name} -> {target}" not in leave_out and package_of(target) != package_of(name):
                out[package_of(name)].add(package_of(target))
    return out


def test_every_package_is_on_one_floor():
    packages = {package_of(name) for name in MODULES}
    assert packages == {p for floor in FLOORS for p in floor}, packages ^ {p for floor in FLOORS for p in floor}
    for package in packages:
        floor_of(package)


def test_no_import_runs_up_the_floors():
    found = upward(graph())
    assert found == PENDING_UPWARD, sorted(found ^ PENDING_UPWARD)


def test_packages_form_no_circle():
    found = circles(package_graph(graph(), leave_out=PENDING_UPWARD))
    assert not found, [sorted(c) for c in found]


def test_the_package_rules_see_an_upward_import_and_a_package_circle():
    edges = {"dofla.train.loop": {"dofla.eval.metrics", "dofla.models.capture"}, "dofla.eval.metrics": {"dofla.train.loop"},
             "dofla.models.capture": set(), "dofla.eval.config": {"dofla.section_keys"}, "dofla.section_keys": set()}
    assert upward(edges) == {"dofla.train.loop -> dofla.eval.metrics"}
    assert circles(package_graph(edges)) == [frozenset({"dofla.train", "dofla.eval"})]
    assert package_graph(edges)["dofla.config"] == set()  # a section config sits on the config floor
