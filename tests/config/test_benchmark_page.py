"""docs/benchmarks.md shows the table of benchmarks/results.md, the last full run_all (one run of one commit),
and run_all writes it there."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_holds_the_last_full_run_verbatim():
    ra = run_all()
    results = (ROOT / "benchmarks" / "results.md").read_text()
    heading = "# dofla speed benchmarks\n\n"
    assert results.startswith(heading)
    body = results[len(heading):]
    assert "Command: `python benchmarks/run_all.py `; full sizes" in body, "results.md is not a full run"
    assert "Code: commit " in body and "uncommitted" not in body, "results.md does not name a clean commit"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    block = page.partition(ra.BEGIN)[2].partition(ra.END)[0]
    assert block == "\n" + body, "docs/benchmarks.md's table is not benchmarks/results.md's: run " \
                                 "`python benchmarks/run_all.py` (it writes both)"


def test_with_table_replaces_only_the_block():
    ra = run_all()
    page = f"intro\n{ra.BEGIN}\nold table\n{ra.END}\nafter\n"
    assert ra.with_table(page, "new table\n") == f"intro\n{ra.BEGIN}\nnew table\n{ra.END}\nafter\n"
    with pytest.raises(SystemExit, match="no .* block"):
        ra.with_table("a page without markers\n", "new table\n")
