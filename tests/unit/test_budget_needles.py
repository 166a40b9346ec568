"""studies.budget_needles: a passkey prompt's needle counted by where it sat, per prompt length."""
from __future__ import annotations

from dofla.report import RunRecord
from studies.budget_needles import needles_table


def test_needles_are_counted_by_where_they_sat_in_each_prompt_length():
    def run(name, hits):  # 8 prompts per length: needle t at (t + 0.5) / 8 of the prompt
        return RunRecord(name, {"seed": 0}, {}, {f"passkey/{who}/T{n}": h for n, h in hits.items()
                                                  for who in ("student", "teacher")})

    late = run("late", {1024: [0, 0, 0, 0, 0, 0, 1, 1], 2048: [0, 0, 1, 1, 1, 1, 1, 1]})
    table = needles_table([("late question", late), ("no records", RunRecord("x", {"seed": 0}, {}, {}))])
    header, _, teacher, row = table.splitlines()
    assert "1,024-token prompt, needle at 1,024" not in header  # no such needle in a 1K prompt
    assert header.count("2,048-token prompt") == 3
    # 1K: needles at 64..448 | 576..960; 2K: 128, 384 | 640, 896 | 1152..1920
    assert row == "| late question | 0/4 | 2/4 | 0/2 | 2/2 | 4/4 |"
    assert teacher.startswith("| teacher | 0/4 | 2/4 |")  # the first scored run's teacher
