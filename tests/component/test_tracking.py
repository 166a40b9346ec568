"""wandb logging works offline (no key, no network) and never blocks."""
from __future__ import annotations

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
