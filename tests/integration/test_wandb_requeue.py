"""wandb through the real CLI as a cluster uses it: a cell SIGKILLed inside training and started
again in the same run directory (a requeue) is one wandb run; a node that cannot reach the wandb
server still finishes its run, offline, with the files in the run directory."""
from __future__ import annotations

import json
import signal

from tests.integration.test_pipeline import run_cli
from tests.wandb_support import binary_log, closed_port, of_kind, summary, unreachable_server


def _dofla(run_dir, cache_dir, env):
    return run_cli("experiment=smoke_tiny", "logger=wandb", f"hydra.run.dir={run_dir}",
                   f"paths.cache_dir={cache_dir}", env=env)


def _stored_id(run_dir) -> str:
    return json.loads((run_dir / "wandb" / "run_id.json").read_text())["id"]


def test_a_killed_and_requeued_run_is_one_wandb_run(tmp_path):
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    offline = {"WANDB_MODE": "offline", "DOFLA_KILL_AT": ""}
    killed = _dofla(run_dir, cache_dir, {**offline, "DOFLA_KILL_AT": "train:layer1:step4"})
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = _dofla(run_dir, cache_dir, offline)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = sorted((run_dir / "wandb").glob("offline-run-*"))  # offline-run-<time>-<id>: one per start
    assert len(starts) == 2 and len({start.name.split("-")[3] for start in starts}) == 1, starts
    run_id = _stored_id(run_dir)
    assert starts[0].name.split("-")[3] == run_id
    for start in starts:  # the killed start's log may hold nothing yet: wandb writes it on its own schedule
        assert {run.run_id for run in of_kind(binary_log(start), "run")} <= {run_id}
    (run,) = of_kind(binary_log(starts[-1]), "run")
    assert run.run_id == run_id
    steps = {m.glob_name: m.step_metric for m in of_kind(binary_log(starts[-1]), "metric") if m.glob_name}
    assert steps == {"train/*": "train/tokens"}  # the resumed layer's curve goes on at its own token count
    final = summary(binary_log(starts[-1]))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads(final["eval/student_ppl"]) == metrics["eval/student_ppl"]


def test_a_server_that_cannot_be_reached_does_not_stop_the_run(tmp_path):
    run_dir = tmp_path / "run"
    result = _dofla(run_dir, tmp_path / "cache", unreachable_server(closed_port()))
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if "cannot log to" in line]
    assert len(said) == 1 and f"wandb sync {run_dir}/wandb/offline-run-*" in said[0], result.stdout[-2000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run,) = of_kind(binary_log(offline), "run")
    assert run.run_id == _stored_id(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads(summary(binary_log(offline))["eval/student_ppl"]) == metrics["eval/student_ppl"]
