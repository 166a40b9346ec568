"""The real ``dofla`` command: its ``dofla:`` lines on the terminal as a person reads them (no time
stamps; errors on stderr) and, with time, logger and level, in the run directory's log file."""
from __future__ import annotations

import os
import re
import subprocess
import sys

TIME = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dofla", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))


def logged(log: str, level: str, line: str) -> bool:
    return re.search(rf"^{TIME}\[dofla(\.\w+)*\]\[{level}\] - {re.escape(line)}$", log, re.MULTILINE) is not None


def test_a_runs_dofla_lines_land_in_its_log_file_with_time_and_level_and_bare_on_the_terminal(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    done = run_cli("experiment=smoke_tiny", f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}")
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("dofla: ")]
    assert len(said) >= 4 and not re.search(TIME, done.stdout)
    log = (run_dir / "cli.log").read_text()  # Hydra's job log: <run dir>/<job name>.log
    assert all(logged(log, "(INFO|WARNING)", line) for line in said), (said, log)
    assert logged(log, "WARNING", next(line for line in said if line.startswith("dofla: warning:")))
    assert len(re.findall(rf"^{TIME}\[dofla", log, re.MULTILINE)) == len(said)  # each line once

    failed = run_cli("experiment=smoke_tiny", f"hydra.run.dir={tmp_path / 'bad'}", f"paths.cache_dir={cache}",
                     "train.layers=[99]")
    error = "dofla: error: train.layers=[99] has entries outside 0..1 (the model has 2 layers)"
    assert failed.returncode == 2 and error in failed.stderr.splitlines() and error not in failed.stdout
    assert logged((tmp_path / "bad" / "cli.log").read_text(), "ERROR", error)
