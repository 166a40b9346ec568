"""Where in a passkey prompt the allocated students recall the needle (``docs/results/budget.md``).

The probe hides prompt t of n at relative depth (t + 0.5) / n (``dofla.eval.longctx.passkey_trials``), so
the per-prompt records say where each needle sat: about depth × length tokens from the start, and the
question about length tokens from the start. The block counts the needles recalled per range of that
position, at each prompt length, per run (test records): a needle as far from the start in both lengths
but twice as far from the question in the longer prompt tells whether the distance to the needle or the
question's place decides recall.
"""
from __future__ import annotations

from dofla.report import RunRecord
from studies.tables import markdown

LENGTHS = (1024, 2048)
RANGES = ((0, 512), (512, 1024), (1024, 2048))  # the needle's position, tokens from the prompt's start


def recalled(hits: list[float], length: int, lo: int, hi: int) -> str:
    """"k/n" of the prompts whose needle sits in [lo, hi) tokens from the start (empty when none does)."""
    inside = [h for t, h in enumerate(hits) if lo <= (t + 0.5) / len(hits) * length < hi]
    return f"{int(sum(inside))}/{len(inside)}" if inside else ""


def needles_table(named: list[tuple[str, RunRecord]]) -> str:
    """A row per (label, run) with passkey records, and the teacher's (the first run's) on top."""
    columns = [(n, lo, hi) for n in LENGTHS for lo, hi in RANGES if lo < n]
    scored = [(label, r) for label, r in named if all(f"passkey/student/T{n}" in r.sequences for n in LENGTHS)]
    if not scored:
        return ""
    rows = []
    first = scored[0][1]
    if all(f"passkey/teacher/T{n}" in first.sequences for n in LENGTHS):
        rows.append(["teacher", *[recalled(first.sequences[f"passkey/teacher/T{n}"], n, lo, hi)
                                  for n, lo, hi in columns]])
    rows += [[label, *[recalled(r.sequences[f"passkey/student/T{n}"], n, lo, hi) for n, lo, hi in columns]]
             for label, r in scored]
    header = ["student (test)", *[f"{n:,}-token prompt, needle at {lo:,}–{hi - 1:,}" for n, lo, hi in columns]]
    return markdown(header, rows)
