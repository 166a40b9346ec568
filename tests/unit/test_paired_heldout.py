"""studies/paired_heldout.py: per-sequence held-out losses, paired between runs."""
from __future__ import annotations

import pytest
import torch

from dofla.eval import heldout_loss
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from studies.paired_heldout import final_student, losses_from, sequence_losses, starts_for


def test_sequence_losses_average_to_the_heldout_loss():
    student = convert(build_tiny_model("llama", seed=0), dims=[8, 8], chunk_size=4)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    per_sequence = sequence_losses(student, tokens)
    assert len(per_sequence) == 3
    assert sum(per_sequence) / 3 == pytest.approx(heldout_loss(student, tokens), rel=1e-5)
    late = sequence_losses(student, tokens, start=10)
    assert late != per_sequence and all(torch.isfinite(torch.tensor(late)))
    assert losses_from(student, tokens, [0, 10]) == {0: per_sequence, 10: late}  # one forward, both starts


def test_the_final_student_is_the_last_stage_written(tmp_path):
    for name in ("student", "student_distilled"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    assert final_student(tmp_path).name == "student_distilled"
    with pytest.raises(SystemExit, match="no student directory"):
        final_student(tmp_path / "missing")


def test_long_text_is_scored_from_every_late_start_inside_it():
    assert starts_for(False, 2048, (512, 1024)) == [0]  # 512-token text: the whole sequence only
    assert starts_for(True, 2048) == [0, 512]
    assert starts_for(True, 2048, (1024, 512, 1024)) == [0, 512, 1024]
    assert starts_for(True, 512, (512, 1024)) == [0]  # no position of the text is that late
