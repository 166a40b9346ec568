"""wandb logging works offline (no key, no network), never blocks, keeps one wandb run per run directory
and survives a server it cannot reach."""
from __future__ import annotations

import contextlib
import json
import re

import pytest

from dofla.config import LoggerConfig
from dofla.tracking import NullTracker, build_tracker, run_tags, seed_group
from dofla.train.live import Live
from tests.wandb_support import (binary_log, closed_port, history_values, of_kind, summary, unavailable_server,
                                 unreachable_server)


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test", group="grid"),
                            {"seed": 0}, tmp_path, "allocation=dof")
    tracker.log({"eval/student_ppl": 12.5, "eval/teacher_ppl": 10.0})
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_none_tracker_is_a_no_op(tmp_path):
    tracker = build_tracker(LoggerConfig(name="none"), {}, tmp_path, "x")
    assert isinstance(tracker, NullTracker)
    tracker.log({"a": 1})
    tracker.finish()
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow  # runs the CLI
def test_a_real_run_logs_config_dof_dims_curves_metrics_and_plots_to_wandb(tmp_path):
    from tests.integration.test_pipeline import run_cli

    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", "logger=wandb", f"hydra.run.dir={run_dir}",
                     f"paths.cache_dir={tmp_path / 'cache'}", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    # wandb 0.2x+ keeps history and config in its binary log (protobuf): the keys are in it verbatim
    log = next(offline.glob("*.wandb")).read_bytes()
    for key in ("eval/student_ppl", "eval/attn_error/layer_01", "allocation/mean_dim", "allocation/dim/layer_01",
                "dof/layer_00", "train/layer_01/final_heldout_loss", "time/train", "tiny:llama",
                # live curves while training, and the tags a run is found by
                "train/layer_01/loss", "train/tokens_per_s", "train/eta_min", "experiment:smoke_tiny",
                "policy:dof"):
        assert key.encode() in log, key
    tables = {p.name.split("_")[0] + "_" + p.name.split("_")[1]: json.loads(p.read_text())
              for p in (offline / "files" / "media" / "table").glob("*.table.json")}
    assert tables["dof_table"]["columns"] == ["layer", "head", "dof", "dim"]
    assert len(tables["dof_table"]["data"]) == 2 * 4  # every (layer, head) of the tiny Llama
    assert tables["train_curves"]["columns"] == ["layer", "step", "loss", "heldout_loss"]
    assert {row[0] for row in tables["train_curves"]["data"]} == {0, 1} and len(tables["train_curves"]["data"]) == 12
    images = {p.name.rsplit("_", 2)[0] for p in (offline / "files" / "media" / "images").glob("*.png")}
    assert {"perplexity", "dims", "attn_error", "dof_heatmap", "training"} <= images


def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _flushed(tracker):
    """Finish the run and stop wandb's service: only then is an offline run's binary log complete
    (the service writes it on its own schedule; a CLI run's exit does the same)."""
    import wandb

    tracker.finish()
    wandb.teardown()


def _wandb_run(tmp_path, sub, seed, policy, group=None, overrides=("eval.tasks=[a,b]", "seed={seed}", "paths.cache_dir=/c")):
    """Start and finish an offline wandb run; its (group, job_type) and its binary log."""
    config = {"seed": seed, "allocation": {"policy": policy}, "cache_dir": str(tmp_path / sub), "logger": {}}
    listed = [o.format(seed=seed) for o in overrides] + [f"allocation={policy}"]
    tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test", group=group), config,
                            tmp_path / sub, ",".join(listed), overrides=listed)
    group_type = (tracker.run.group, tracker.run.job_type)
    _flushed(tracker)
    (offline,) = (tmp_path / sub / "wandb").glob("offline-run-*")
    return group_type, next(offline.glob("*.wandb")).read_bytes()


def test_wandb_groups_runs_that_differ_only_in_seed_and_types_them_by_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (group0, type0), log0 = _wandb_run(tmp_path, "a", 0, "dof")
    (group1, _), _ = _wandb_run(tmp_path, "b", 1, "dof")
    (group_fix, type_fix), _ = _wandb_run(tmp_path, "c", 0, "fix")
    assert group0 == group1 != group_fix and (type0, type_fix) == ("dof", "fix")
    assert group0.startswith("eval.tasks=[a,b],allocation=dof-") and "seed" not in group0
    assert group0.encode() in log0 and b"dof" in log0
    (given, _), _ = _wandb_run(tmp_path, "d", 0, "dof", group="my-grid")
    assert given == "my-grid"


def test_the_seed_group_takes_hydras_override_list_whole():
    # a quoted value holding a comma and "seed=" is one override; re-splitting the joined string would
    # cut it and drop its "seed=2'" fragment as if it were the seed
    overrides = ["+note='x,seed=2'", "seed=1", "paths.cache_dir=/c"]
    group = seed_group({"seed": 1}, overrides)
    assert group.startswith("+note='x,seed=2'-") and "seed=1" not in group and "/c" not in group
    assert seed_group({"seed": 2}, ["+note='x,seed=2'", "seed=2"]) == group
    assert seed_group({"seed": 1}, []).startswith("default-")


def test_a_wandb_login_counts_as_logged_in_and_offline_is_said(tmp_path, monkeypatch, capsys):
    from dofla.tracking import wandb_mode

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    cfg = LoggerConfig(name="wandb", project="dofla-test")
    assert wandb_mode(cfg) == "offline"  # no key, no netrc
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert wandb_mode(cfg) == "online"  # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode(cfg) == "offline"  # the key is for another host
    assert wandb_mode(LoggerConfig(name="wandb", mode="disabled")) == "disabled"
    netrc.write_text("")
    tracker = build_tracker(cfg, {"seed": 0}, tmp_path, "x")
    tracker.finish()
    out = capsys.readouterr().out
    assert "wandb logs offline" in out and "no WANDB_API_KEY and no `wandb login`" in out and "wandb sync" in out


def test_tags_name_the_experiment_the_sweep_and_the_methods_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"allocation": {"policy": "dof"}, "loss": {"name": "softmax"}, "feature_map": {"name": "hedgehog"},
              "attention": {"name": "linear"}, "seed": 0}
    tags = run_tags(config, "paper_gpt2", "multirun_sweeps/paper_gpt2/2026-11-25/14-02-11")
    assert tags == ["experiment:paper_gpt2", "sweep:2026-11-25/14-02-11", "policy:dof", "loss:softmax",
                    "features:hedgehog", "attention:linear"]
    assert run_tags({"loss": {"name": "direct"}}) == ["loss:direct"]  # a single run outside any sweep
    tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test"), config, tmp_path, "x", tags)
    assert list(tracker.run.tags) == tags
    tracker.finish()


def test_one_run_directory_is_one_wandb_run_across_restarts(tmp_path, monkeypatch):
    _offline(monkeypatch)
    ids = []
    for _ in range(2):  # a start, then a resume of the same directory (a requeued job)
        tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test"), {"seed": 0}, tmp_path / "a", "x")
        ids.append(tracker.run.id)
        _flushed(tracker)
    other = build_tracker(LoggerConfig(name="wandb", project="dofla-test"), {"seed": 0}, tmp_path / "b", "x")
    ids.append(other.run.id)
    _flushed(other)
    assert ids[0] == ids[1] != ids[2]
    starts = sorted((tmp_path / "a" / "wandb").glob("offline-run-*"))
    assert len(starts) == 2  # wandb keeps each start's files apart; one id names both
    for start in starts:
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0]}(-\d+)?", start.name), start.name
        (run,) = of_kind(binary_log(start), "run")
        assert run.run_id == ids[0]


def test_live_curves_use_their_stages_token_counter_as_step_and_heldout_losses_keep_the_minimum(
        tmp_path, monkeypatch):
    _offline(monkeypatch)
    tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test"), {"seed": 0}, tmp_path, "x")
    train = Live(tracker.log, 1, total=96, prefix="train")
    for step, heldout in zip((1, 2, 3), (3.0, 1.0, 2.0)):
        train.log(step, 32 * step, {"layer_00/loss": 4.0 / step, "layer_00/heldout_loss": heldout})
    distill = Live(tracker.log, 1, total=16, prefix="distill")
    for step in (1, 2):
        distill.log(step, 8 * step, {"kl": 1.0 / step})
    tracker.log({"train/layer_00/final_heldout_loss": 1.0, "eval/student_ppl": 12.5})  # the report's scalars
    _flushed(tracker)
    log = binary_log(next((tmp_path / "wandb").glob("offline-run-*")))
    metrics = of_kind(log, "metric")
    assert {m.glob_name: m.step_metric for m in metrics if m.glob_name} == {
        "train/*": "train/tokens", "distill/*": "distill/tokens"}
    heldout = [m for m in metrics if m.name.endswith("heldout_loss") and not m.expanded_from_glob]  # (older wandb)
    assert {m.name for m in heldout} == {"train/layer_00/heldout_loss"}
    assert {m.step_metric for m in heldout} == {"train/tokens"} and any(m.summary.min for m in heldout)
    final = summary(log)
    assert json.loads(final["train/layer_00/heldout_loss"]) == {"min": 1.0}  # the best, not the last (2.0)
    assert json.loads(final["train/layer_00/final_heldout_loss"]) == 1.0 and json.loads(final["distill/kl"]) == 0.5
    assert [json.loads(v) for v in history_values(log, "distill/tokens")] == [8, 16]


@pytest.mark.slow  # waits for wandb.init's timeout
@pytest.mark.parametrize("server", ["closed port", "answers 503"])
def test_a_server_that_cannot_be_used_turns_the_run_offline_instead_of_stopping_it(
        server, tmp_path, monkeypatch, capsys):
    with contextlib.ExitStack() as stack:
        # a closed port fails the check before wandb.init; a server that answers but is not wandb
        # makes wandb.init itself give up (CommError), and wandb's service is restarted offline
        port = closed_port() if server == "closed port" else stack.enter_context(unavailable_server())
        for key, value in unreachable_server(port).items():
            monkeypatch.setenv(key, value)
        tracker = build_tracker(LoggerConfig(name="wandb", project="dofla-test"), {"seed": 0}, tmp_path, "x")
        tracker.log({"eval/student_ppl": 12.5})
        run_id = tracker.run.id
        _flushed(tracker)
    lines = [line for line in capsys.readouterr().out.splitlines() if "cannot log to" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
    assert ("ConnectionRefusedError" if server == "closed port" else "CommError") in lines[0]
    assert f"wandb sync {tmp_path}/wandb/offline-run-*" in lines[0]
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    (run,) = of_kind(binary_log(offline), "run")
    assert run.run_id == run_id
    assert json.loads(summary(binary_log(offline))["eval/student_ppl"]) == 12.5
