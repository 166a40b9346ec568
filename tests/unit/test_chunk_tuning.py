"""``attention.chunk_size=auto``: measured once per machine and shape, remembered, read afterwards."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dofla.attention import tuning
from dofla.config import RunConfig
from dofla.errors import ConfigError
from dofla.models.tiny import build_tiny_model
from dofla.stages.students import chunk_size, make_student
from dofla.validate import validate_config

CPU = torch.device("cpu")


def test_every_candidate_is_timed_and_the_fastest_is_kept_and_remembered(tmp_path, monkeypatch):
    seconds = tuning.measure(2, 8, 4, CPU, length=256, repeats=1)
    assert sorted(seconds) == list(tuning.CANDIDATES) and all(s > 0 for s in seconds.values())
    best = tuning.best_chunk_size(2, 8, 4, CPU, tmp_path, length=256)
    stored = json.loads((tmp_path / tuning.FILE).read_text())
    (entry,) = stored.values()
    assert entry["chunk_size"] == best == int(min(entry["seconds"], key=entry["seconds"].get))

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tuning, "measure", no_measuring)
    assert tuning.best_chunk_size(2, 8, 4, CPU, tmp_path, length=256) == best  # read, not measured
    with pytest.raises(AssertionError, match="measured again"):  # another shape is another measurement
        tuning.best_chunk_size(2, 16, 4, CPU, tmp_path, length=256)


def test_an_unreadable_record_is_measured_again_and_rewritten(tmp_path):
    (tmp_path / tuning.FILE).write_text("{not json")
    best = tuning.best_chunk_size(2, 8, 4, CPU, tmp_path, length=128)
    assert best in tuning.CANDIDATES
    assert len(json.loads((tmp_path / tuning.FILE).read_text())) == 1


def test_a_run_with_auto_builds_its_student_at_the_measured_chunk(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOFLA_CACHE_DIR", str(tmp_path))
    base = RunConfig()
    cfg = dataclasses.replace(base, attention=dataclasses.replace(base.attention, chunk_size="auto"))
    validate_config(cfg)
    teacher = build_tiny_model("llama", seed=0)
    chosen = chunk_size(cfg, teacher, [8, 8])
    assert chosen in tuning.CANDIDATES and (tmp_path / tuning.FILE).exists()
    assert "attention.chunk_size=auto is" in capsys.readouterr().out
    student = make_student(cfg, teacher, [8, 8])
    assert {a.chunk_size for a in student.student_attentions()} == {chosen}
    assert student.config.dofla["chunk_size"] == chosen  # the saved student records the number


@pytest.mark.parametrize("attention,value", [("linear", "fast"), ("linear", 0), ("hybrid", "auto")])
def test_a_bad_chunk_size_is_one_sentence(attention, value):
    base = RunConfig()
    cfg = dataclasses.replace(base, attention=dataclasses.replace(base.attention, name=attention, chunk_size=value,
                                                                  window=64 if attention == "hybrid" else 0))
    with pytest.raises(ConfigError, match="attention.chunk_size") as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)
