"""Every ``dofla`` command a user can copy from README.md, docs/ or a reproduction script composes.

The bash blocks of README.md and docs/, and the scripts under studies/, are run by bash with stand-ins
for dofla's programs (and python) first on PATH: the stand-ins only record their arguments, so shell
variables and loops expand exactly as in a user's shell. A block that runs anything else (installs,
git, make) is read line by line instead, and a dofla line there may not use a shell variable. Each
recorded ``dofla`` / ``dofla-prepare`` / ``dofla-eval`` command is then composed by Hydra, every cell of
a ``-m`` sweep included, and validated: everything the command does before it loads a model.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.validate import validate_config
from tests.config.test_readme_commands import sweep_cells

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ("dofla", "dofla-prepare", "dofla-report", "dofla-eval", "python", "python3", "torchrun")
SAFE = RECORDED + ("for", "do", "done", "export", "set", "echo", "then", "fi", "if", "true")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
COMPOSED = ("dofla", "dofla-prepare", "dofla-eval")
PLACEHOLDER = "/path/to/"  # a page's stand-in for the reader's own directory


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def scripts() -> list[Path]:
    return sorted((ROOT / "studies").rglob("*.sh"))


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), flags=re.S)


def logical_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def runnable(block: str) -> bool:
    """Whether every command of the block is a stand-in, an assignment or shell syntax."""
    for line in logical_lines(block):
        for segment in re.split(r";|&&|\|\|", line):
            words = segment.split()
            while words and words[0] in ("do", "then", "!"):
                words = words[1:]
            if words and not (words[0] in SAFE or ASSIGNMENT.match(words[0])):
                return False
    return True


def record(script: str, tmp: Path, cwd: Path = ROOT, argv0: str = "script") -> list[list[str]]:
    """Run ``script`` under bash with the stand-ins (``argv0``: its $0, a script file's path so that it finds
    the repository as it does when run); the argument lists they were called with."""
    stubs, log = tmp / "bin", tmp / "calls.jsonl"
    stubs.mkdir(exist_ok=True)
    for name in RECORDED:
        stub = stubs / name
        stub.write_text(f"#!{sys.executable}\nimport json, os, sys\nwith open(os.environ['DOC_COMMANDS_LOG'], 'a') as f:\n"
                        "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "DOC_COMMANDS_LOG": str(log)}
    done = subprocess.run(["bash", "-c", script, argv0], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def static_commands(block: str) -> list[list[str]]:
    """dofla lines of a block that is not run: each must be complete as written."""
    out = []
    for line in logical_lines(block):
        for part in line.split("&&"):
            words = shlex.split(part)
            if words and words[0] in COMPOSED:
                assert "$" not in part, f"`{part.strip()}` uses a shell variable in a block that runs other programs"
                out.append(words)
    return out


def commands(source: Path, tmp: Path) -> list[list[str]]:
    if source.suffix == ".sh":
        return record(source.read_text(), tmp, argv0=str(source))
    found = []
    for i, block in enumerate(bash_blocks(source)):
        if runnable(block):
            (tmp / f"block{i}").mkdir()
            found += record(block, tmp / f"block{i}")
        else:
            found += static_commands(block)
    return found


def overrides_of(argv: list[str]) -> tuple[list[str], bool] | None:
    """(Hydra overrides, multirun) of a composed program's arguments; None when it only prints help."""
    program, args = argv[0], argv[1:]
    if program == "dofla-eval":  # DIR [--out OUT] overrides
        args = [a for i, a in enumerate(args) if i > 0 and a != "--out" and (i == 0 or args[i - 1] != "--out")]
    if any(a.startswith("--") for a in args):
        return None
    return [a for a in args if a not in ("-m", "--multirun")], "-m" in args


# The results pages of the earlier protocol and their study script compose about 300 commands (Hydra
# takes about half a second each here): the long tier checks them; README, the guides, the headline page
# and its script stay in the default run.
EARLIER = {*(f"docs/results/{name}.md" for name in ("dof_allocation", "embedded_sweeps", "hybrid_far_context",
                                                    "model_distillation", "softmax_layers", "window_and_hybrid")),
           "studies/quality.sh"}
SOURCES = [pytest.param(p, marks=pytest.mark.long) if p.relative_to(ROOT).as_posix() in EARLIER else p
           for p in [*pages(), *scripts()]]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dofla_command_composes_and_validates(source, tmp_path):
    for argv in commands(source, tmp_path):
        if argv[0] not in COMPOSED or (parsed := overrides_of(argv)) is None:
            continue
        overrides, multirun = parsed
        for cell in sweep_cells(overrides, multirun):
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = to_run_config(compose(config_name="config", overrides=cell))
            if not any(PLACEHOLDER in o for o in cell):  # a placeholder path cannot pass the file checks
                validate_config(cfg)


def test_the_headline_script_runs_every_preset_over_three_data_orders(tmp_path):
    script = ROOT / "studies" / "reproduce" / "headline.sh"
    calls = record(script.read_text(), tmp_path, argv0=str(script))
    runs = {(a[1], a[2]) for a in calls if a[0] == "dofla"}
    presets = {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}
    assert {e.removeprefix("experiment=") for e, _ in runs} <= presets
    assert {s for _, s in runs} == {"seed=0", "seed=1", "seed=2"}
    assert [a[:3] for a in calls if a[0] == "python"][-1] == ["python", "-m", "studies.results"]


def test_a_quoted_override_held_in_a_variable_is_caught(tmp_path):
    block = "G=\"'distill.train=[features,attention,gate]'\"\ndofla distill=kl $G\n"
    (argv,) = record(block, tmp_path)
    with pytest.raises(Exception):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="config", overrides=overrides_of(argv)[0])
