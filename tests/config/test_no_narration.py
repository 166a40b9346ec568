"""The repository's text describes the software and its results, never how or when it was made: no
"session 53", "this round", "built this", "under way" in README.md, docs/, studies/, conf/ or src/.
Dates of results are fine."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AREAS = ("README.md", "docs", "studies", "conf", "src")
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".txt", ".toml", ".csv"}
NARRATION = re.compile("|".join((
    r"\bsessions?[- ]\d+",                # "session 53", an anchor's "session-53"
    r"(?<![-\w])rounds?[- ]\d+",          # "round 5", not the option "--rounds 5"
    r"\b(?:this|that|same|each|every|next|previous|earlier|later|first|last) (?:session|round)s?\b",
    r"\bthis project's sessions\b",
    r"\bclosing notes\b",
    r"\bbuilt this\b",
    r"\bunder way\b",
    r"\bwe (?:added|built|now)\b",
    r"\bwe measured next\b",
    r"\bwhat would be measured next\b",
)), flags=re.IGNORECASE)


def narration(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line that narrates how or when the project was made."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if NARRATION.search(line)]


def area_files(area: str) -> list[Path]:
    path = ROOT / area
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)


def test_the_patterns_find_narration():
    found = narration("made in session 53\n[x](page.md#result-2026-11-28-session-54)\nin round 5 of the work\n"
                      "built this round\nThis session adds it\nthe same session\ntwo runs are under way\n"
                      "we added a flag\nthe closing notes of each round")
    assert [number for number, _ in found] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_the_patterns_spare_ordinary_words():
    text = ("values rounded to 0.001\naround 5 minutes\na round trip to the hub\n"
            "python -m benchmarks.bench_stream --rounds 5\nthe other way round\nround(C * N / mean N)\n"
            "5 rounds of interleaved pairs\nthe session's directory\nmeasured on 2026-11-28")
    assert narration(text) == []


@pytest.mark.parametrize("area", AREAS)
def test_no_narration_of_how_the_project_was_made(area):
    hits = [f"{path.relative_to(ROOT)}:{number}: {line[:160]}"
            for path in area_files(area) for number, line in narration(path.read_text(errors="replace"))]
    assert not hits, "text narrates how the project was made (describe the software and its results " \
                     "instead; dates of results are fine):\n" + "\n".join(hits)
