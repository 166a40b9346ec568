"""studies/paired_heldout.py: per-sequence held-out losses, paired between runs."""
from __future__ import annotations

import pytest
import torch

from dofla.eval import heldout_loss
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from studies.paired_heldout import compare_pairs, final_student, is_hybrid, losses_from, scored, sequence_losses, starts_for


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


def _saved(directory, seed, **options):
    """A run directory holding a tiny converted student (``student/``) of the given form."""
    student = convert(build_tiny_model("llama", seed=seed), dims=[8, 8], chunk_size=4, **options)
    student.save_pretrained(directory / "student")
    return directory


def test_scores_are_kept_per_text_and_weights_and_reused(tmp_path):
    run = _saved(tmp_path / "run", 0, attention="hybrid", window=4, sinks=1)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    first, model = scored(run, tokens, [0, 10])
    assert model is not None and first == losses_from(model, tokens, [0, 10])
    again, loaded = scored(run, tokens, [10])
    assert loaded is None and again == {10: first[10]}  # read back: no model was loaded
    removed, _ = scored(run, tokens, [0], ablate=True)
    assert removed[0] != first[0]  # the linear part removed is scored, and kept apart
    other, _ = scored(run, tokens[:, :16], [0])
    assert other[0] != first[0]  # other text: scored again
    assert is_hybrid(run) and not is_hybrid(_saved(tmp_path / "linear", 0))


def test_matched_pairs_average_over_pairs_with_an_interval_over_runs(tmp_path, monkeypatch):
    import studies.paired_heldout as study

    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(study, "held_out", lambda run, long, long_seqs=None: tokens)  # tiny runs hold no data config
    form = {"attention": "hybrid", "window": 4, "sinks": 1}
    pairs = [(_saved(tmp_path / f"c{i}", 10 + i, **form), _saved(tmp_path / f"s{i}", 20 + i, **form)) for i in range(3)]
    table = compare_pairs(pairs, ablate=True).splitlines()
    per_pair = []
    for control, student in pairs:
        c, _ = scored(control, tokens, [0])
        s, _ = scored(student, tokens, [0])
        per_pair.append(sum(a - b for a, b in zip(s[0], c[0])) / len(tokens))
    mean, half = study.mean_ci(per_pair)
    assert len(table) == 4 + 3 + 1 and table[-1].startswith("| mean over 3 pairs | ")
    assert table[-1].split(" | ")[1] == f"**{mean:+.4f}** ± {half:.4f}"
    assert table[4].startswith("| s0 − c0 | ")
    with pytest.raises(SystemExit, match="needs hybrid students"):
        compare_pairs([(pairs[0][0], _saved(tmp_path / "lin", 0))], ablate=True)
