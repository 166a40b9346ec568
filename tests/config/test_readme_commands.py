"""Every command in README.md's code blocks is run by a test or by CI.

``dofla`` and ``dofla-prepare`` lines are composed exactly as written (a ``-m`` line: every cell of
its sweep, the experiment's own grid included) and validated, which is everything they do before
loading a model; the other programs are run by the tests named in ``RUN_BY``; ``make`` by CI.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from dofla.cli import CONF_DIR, to_run_config
from dofla.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
# program -> the test (or CI step) that runs it for real
RUN_BY = {
    "make run": ".ci/run",
    "make test": ".ci/run",
    "dofla-report": "tests/integration/test_seed_report.py",
    "dofla-eval": "tests/integration/test_eval_saved.py",
    "lm_eval": "tests/component/test_export.py",
}


def readme_commands() -> list[str]:
    """Each command of README.md's ```bash blocks (a line, or each part of a line joined by &&),
    without its comment."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.splitlines()]
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def sweep_cells(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of every job the command starts (one without ``-m``); an experiment's
    own grid (hydra.sweeper.params) is added as Hydra's sweeper adds it."""
    if not multirun:
        return [overrides]
    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra_cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
    grid = [f"{k}={v}" for k, v in (hydra_cfg.hydra.sweeper.params or {}).items()]
    parsed = parser.parse_overrides([*grid, *overrides])
    return [cell for batch in BasicSweeper.split_arguments(parsed, None) for cell in batch]


def test_readme_has_the_commands_this_test_expects():
    programs = {" ".join(shlex.split(c)[:2]) if c.startswith("make") else shlex.split(c)[0] for c in readme_commands()}
    assert {"make run", "make test", "dofla", "dofla-prepare", "dofla-report"} <= programs
    unknown = programs - set(RUN_BY) - {"dofla", "dofla-prepare"}
    assert not unknown, f"README.md runs {unknown}: add each to RUN_BY with the test that runs it"
    for program, runner in RUN_BY.items():
        text = (ROOT / runner).read_text()
        assert re.search(rf"^\s*{re.escape(program)}\b" if program.startswith("make") else re.escape(program), text,
                         flags=re.M), f"{runner} does not run {program}"


@pytest.mark.parametrize("command", [c for c in readme_commands() if c.split()[0] in ("dofla", "dofla-prepare")])
def test_readme_dofla_command_composes_and_validates(command):
    args = shlex.split(command)[1:]
    multirun = "-m" in args
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    cells = sweep_cells(overrides, multirun)
    assert cells and all(cells)
    for cell in cells:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = to_run_config(compose(config_name="config", overrides=cell))
        validate_config(cfg)
    if "experiment=paper_gpt2" in args and multirun:
        assert len(cells) == 11  # the paper's GPT-2 grid
