"""The house's import rules: libraries know nothing of runs (no import of the stages, the pipeline or
the CLI, even inside a function), and module-level imports form no circle."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
RUN_LEVEL = ("dofla.stages", "dofla.pipeline", "dofla.cli", "dofla.evaluate_saved")
LIBRARIES = ("dofla.attention", "dofla.feature_maps", "dofla.dof", "dofla.train", "dofla.eval", "dofla.models",
             "dofla.cache", "dofla.data", "dofla.report")


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "dofla").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dofla"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("dofla"))
    return out


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_libraries_import_nothing_of_a_run():
    upward = {f"{name} -> {target}" for name, path in modules().items() if within(name, LIBRARIES)
              for target in imports(path, top_level_only=False) if within(target, RUN_LEVEL)}
    assert not upward, sorted(upward)


def test_module_level_imports_form_no_circle():
    mods = modules()
    graph = {name: {t for t in imports(path, top_level_only=True) if t in mods and t != name}
             for name, path in mods.items()}
    for name in graph:  # a package's __init__ importing its own modules is not a circle
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles
