"""The test tiers: every test conftest.SLOW names exists (a renamed test would silently join the fast
tier), and the fast tier is tests/unit + tests/component less the slow tests and the variants."""
from __future__ import annotations

import ast

from tests.conftest import ROOT, SLOW, SLOW_TOO


def test_every_test_marked_slow_by_name_exists():
    missing = []
    for file, names in [*SLOW.items(), *SLOW_TOO.items()]:
        tree = ast.parse((ROOT / file).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        missing += [f"{file}::{name}" for name in names if name not in defined]
    assert not missing, missing


def test_make_test_fast_runs_the_unit_and_component_tests_not_marked_slow():
    rule = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "pytest" in line and
                "not slow" in line)
    assert "tests/unit tests/component" in rule and '-m "not slow and not variant and not grid and not long"' in rule
