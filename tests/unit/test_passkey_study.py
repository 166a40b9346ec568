"""studies/passkey.py: passkey recall and answer NLL of saved students, paired per prompt."""
from __future__ import annotations

import pytest
import torch

from dofla.eval.longctx import passkey_trials
from dofla.models import convert, load_student
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from studies.passkey import main, pairs_table, rows_for, table


def _saved(directory, seed, **options):
    student = convert(build_tiny_model("llama", seed=seed), dims=[8, 8], chunk_size=4, **options)
    student.save_pretrained(directory / "student")
    build_byte_tokenizer().save_pretrained(directory / "student")
    return directory


def test_every_student_answers_the_same_prompts_and_is_paired_with_its_reference(tmp_path, capsys):
    linear = _saved(tmp_path / "linear", 0)
    hybrid = _saved(tmp_path / "hybrid", 1, attention="hybrid", window=8, sinks=1)
    rows = rows_for([linear, hybrid], length=160, trials=3, seed=0, ablate=True, teacher=False)
    assert [(name, ref) for name, _, ref in rows] == [
        ("linear", None), ("hybrid", 0), ("hybrid, linear part removed", 1)]
    again = passkey_trials(load_student(hybrid / "student").eval(), build_byte_tokenizer(), 160, 3,
                           torch.Generator().manual_seed(0))
    assert [n for _, n in rows[1][1]] == pytest.approx([n for _, n in again])  # the same prompts, the same scores
    assert rows[2][1] != rows[1][1]  # the linear part removed answers differently
    text = table(rows, 160)
    diffs = [a - b for (_, a), (_, b) in zip(rows[1][1], rows[0][1])]
    assert f"| hybrid | 0/3 | {sum(n for _, n in rows[1][1]) / 3:.2f} | {sum(diffs) / 3:+.2f} ± " in text
    assert "| linear | 0/3 |" in text and "| reference |" in text and "(vs hybrid) |" in text
    main([str(linear), str(linear), "--length", "160", "--trials", "2", "--out", str(tmp_path / "p.md")])
    assert "| +0.00 ± 0.00 (vs linear) |" in capsys.readouterr().out  # a student against itself
    assert (tmp_path / "p.md").read_text().startswith("`python -m studies.passkey ")


def test_pairs_compare_each_student_with_its_own_control_and_average_over_pairs(tmp_path, capsys):
    runs = [_saved(tmp_path / f"run{i}", i, **({"attention": "hybrid", "window": 8, "sinks": 1} if i % 2 else {}))
            for i in range(4)]  # control 0, student 1, control 2, student 3
    rows = rows_for(runs, length=160, trials=3, seed=0, ablate=False, teacher=False)
    text = pairs_table(rows, 160)
    per_pair = []
    for c, s in ((0, 1), (2, 3)):
        diffs = [a - b for (_, a), (_, b) in zip(rows[s][1], rows[c][1])]
        per_pair.append(sum(diffs) / 3)
        assert f"| run{s} − run{c} | 0 / 0 of 3 | +0 | {per_pair[-1]:+.2f} ± " in text
    assert f"| mean over 2 pairs (95 % t over pairs) | | **+0.0** ± 0.0 | **{sum(per_pair) / 2:+.2f}** ± " in text
    with pytest.raises(SystemExit):
        main([str(r) for r in runs[:3]] + ["--pairs"])  # an odd count is not pairs
    main([str(runs[0]), str(runs[1]), "--pairs", "--length", "160", "--trials", "2"])
    assert "| run1 − run0 |" in capsys.readouterr().out
