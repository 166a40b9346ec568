"""wandb logging works offline (no key, no network) and never blocks."""
from __future__ import annotations

import json

from dofla.config import LoggerConfig
from dofla.tracking import NullTracker, build_tracker


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


def test_a_real_run_logs_config_dof_dims_curves_metrics_and_plots_to_wandb(tmp_path):
    from tests.integration.test_pipeline import run_cli

    run_dir = tmp_path / "run"
    result = run_cli("experiment=smoke_tiny", "logger=wandb", f"hydra.run.dir={run_dir}",
                     f"cache_dir={tmp_path / 'cache'}", env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    # wandb 0.2x+ keeps history and config in its binary log (protobuf): the keys are in it verbatim
    log = next(offline.glob("*.wandb")).read_bytes()
    for key in ("eval/student_ppl", "eval/attn_error/layer_01", "allocation/mean_dim", "allocation/dim/layer_01",
                "dof/layer_00", "train/layer_01/final_heldout_loss", "time/train", "tiny:llama"):
        assert key.encode() in log, key
    tables = {p.name.split("_")[0] + "_" + p.name.split("_")[1]: json.loads(p.read_text())
              for p in (offline / "files" / "media" / "table").glob("*.table.json")}
    assert tables["dof_table"]["columns"] == ["layer", "head", "dof", "dim"]
    assert len(tables["dof_table"]["data"]) == 2 * 4  # every (layer, head) of the tiny Llama
    assert tables["train_curves"]["columns"] == ["layer", "step", "loss", "heldout_loss"]
    assert {row[0] for row in tables["train_curves"]["data"]} == {0, 1} and len(tables["train_curves"]["data"]) == 12
    images = {p.name.rsplit("_", 2)[0] for p in (offline / "files" / "media" / "images").glob("*.png")}
    assert {"perplexity", "dims", "attn_error", "dof_heatmap", "training"} <= images
