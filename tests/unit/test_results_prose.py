"""Every number the results prose states is one the committed records give, or a fixed fact named here.

The prose checked is README's results section and the answers of the pages studies.results builds (each
page's ``**Answer`` paragraphs and the bullets that follow them), their generated blocks taken out. A
number there must be a number of some block studies.results computes from the committed records (a
table cell, a range's end, a count), an interval must be one of those cells whole, and anything else must
be in ALLOWED: the corpus, the protocol's settings and the model's shape, each with why it is not a result.
"""
from __future__ import annotations

import re

import pytest

from studies import results

# A number standing alone: not part of a name (fp32, Q4_1, SmolLM2-135M, 1K) or of a longer number.
NUMBER = re.compile(r"(?<![\w.,])[+−-]?\d+(?:,\d{3})*(?:\.\d+)?(?![\w]|[.,]\d)")
INTERVAL = re.compile(r"[+−-]?\d+\.\d+ ± \d+\.\d+")
SHARE = re.compile(r"\d+\.\d+ \[[+−-]?\d+\.\d+, [+−-]?\d+\.\d+\]")
# Fixed facts and settings the prose may state without a record: what each is.
ALLOWED = {
    "0": "a data order (seed), or none recalled: every block has 0",
    "1": "data order 1, one run",
    "2": "data order 2; λ = 2⁻⁴ and 2⁻⁸ are the paper's",
    "4": "the window's 4 sink tokens; method §4",
    "10": "every 10th chapter is held out; λ = 10⁻² of the trace",
    "16": "J-samples averaged per head by the project's variant of Algorithm 1",
    "64": "the window's 64 tokens; the feature budget C = 64 per layer",
    "95": "the intervals' level, 95 %",
    "100": "passkey prompts per length",
    "256": "MQAR length T = 256",
    "512": "J = 512 samples per head (the variant's setting)",
    "1,024": "context length and the start of the far-context bucket",
    "2,047": "the end of the far-context bucket",
    "2,048": "J = 2,048 of the paper's form; 2,048-token text",
    "8,192": "a context length decode memory is measured at",
    "65,536": "tokens of each training stage and of the held-out text scored",
}


def answers(path) -> str:
    """README's results section, or a page's answers: each ``**Answer`` paragraph and the bullets after it,
    its generated blocks, inline code and link targets taken out."""
    text = results.BLOCK.sub("", path.read_text())
    if path.name == "README.md":
        kept = [text.split("## Results", 1)[1].split("\n## ", 1)[0]]
    else:
        kept, taking = [], False
        for paragraph in text.split("\n\n"):
            taking = paragraph.startswith("**Answer") or (taking and paragraph.startswith("- "))
            kept += [paragraph] if taking else []
    return re.sub(r"`[^`]*`|\]\([^)]*\)", "", "\n\n".join(kept))


def built() -> list[str]:
    """Every block studies.results builds from the committed records."""
    return [block for name, build in results.PAGES.items() for block in build(*results.sources_of(name)).values()]


def computed() -> str:
    """Every block studies.results builds from the committed records, as one text."""
    return "".join(built()).replace("−", "-")


def unsigned(number: str) -> str:
    return number.lstrip("+−-")


@pytest.fixture(scope="module")
def blocks() -> str:
    return computed()


@pytest.mark.parametrize("page", ["README", "headline", "dof_allocation", "budget"])
def test_every_number_the_prose_states_comes_from_a_record_or_is_a_named_fact(page, blocks):
    prose = answers(results.page_path(page))
    assert prose.strip(), f"{page} has no answer to check"
    known = {unsigned(n) for n in NUMBER.findall(blocks)}
    untraced = sorted({unsigned(n) for n in NUMBER.findall(prose)} - known - set(ALLOWED))
    assert not untraced, f"{page} states {untraced}, which no record gives and ALLOWED does not name"


@pytest.mark.parametrize("page", ["README", "headline", "dof_allocation", "budget"])
def test_every_interval_the_prose_quotes_is_a_cell_the_records_give(page, blocks):
    """An interval is quoted whole: its mean and half-width together, as one cell has them."""
    prose = answers(results.page_path(page))
    for interval in INTERVAL.findall(prose) + SHARE.findall(prose):
        assert unsigned(interval.replace("−", "-")) in blocks, f"{page} quotes {interval}, which no record gives"


def test_a_number_no_record_gives_is_caught(tmp_path, blocks):
    """The check fails on the slips it is for: a range's end mistyped, a number typed by hand, an
    interval's half-width mistyped; numbers outside the answers are not read."""
    page = tmp_path / "page.md"
    page.write_text("# p\n\nIntro 77.77.\n\n**Answer.** Loss 5.06 against 4.39; DoF 2.3–6.983; −0.072 ± 0.009.\n\n"
                    "- bullet 12.34\n\nAfter 88.88.\n")
    prose = answers(page)
    known = {unsigned(n) for n in NUMBER.findall(blocks)}
    assert {"5.06", "4.39", "2.3", "0.072", "0.009"} <= known  # each number alone is some record's
    assert sorted({unsigned(n) for n in NUMBER.findall(prose)} - known - set(ALLOWED)) == ["12.34", "6.983"]
    assert INTERVAL.findall(prose) == ["−0.072 ± 0.009"] and "-0.072 ± 0.009" not in blocks


def test_numbers_inside_names_and_settings_are_not_read_as_results():
    text = "fp32, Q4_1, SmolLM2-135M, passkey @ 1K, `seed=0,1,2`, 3.58× and 1,024–2,047 and −0.036"
    assert [unsigned(n) for n in NUMBER.findall(re.sub(r"`[^`]*`", "", text))] == ["3.58", "1,024", "2,047", "0.036"]


def test_no_share_on_a_page_has_a_normal_interval_or_a_bound_outside_0_and_1():
    """Passkey and MQAR cells are shares: a Wilson interval inside [0, 1] with its count, never "± ", and
    a difference of two shares stays inside [−1, 1]."""
    shares = 0
    for table in built():
        lines = [line.split(" | ") for line in table.replace("−", "-").strip().splitlines() if line.startswith("|")]
        columns = [i for i, name in enumerate(lines[0] if lines else []) if "passkey" in name or name.startswith("T = ")]
        for row in lines[2:]:
            for cell in (row[i] for i in columns):
                assert "±" not in cell or "per example" in cell, f"a share with a normal interval: {cell}"
                for low, high in re.findall(r"\[([+-]?[\d.]+), ([+-]?[\d.]+)\]", cell):
                    bound = -1.0 if cell.startswith(("+", "-")) else 0.0
                    assert bound <= float(low) <= float(high) <= 1.0, cell
                    shares += 1
    assert shares >= 20  # the headline's passkey cells, its comparisons and the MQAR table were read
