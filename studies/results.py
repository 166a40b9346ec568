"""The results pages' generated parts, recomputed from the committed run records.

``python -m studies.results PAGE [--check]``

A results page (``docs/results/<PAGE>.md``), and README.md for the headline, hold blocks between
``<!-- results: PAGE BLOCK -->`` and ``<!-- /results -->``. This command rewrites them from the records
in ``docs/results/runs/<PAGE>/`` (``dofla.report.collect_record``; ``SOURCES`` names the record
directories of a page that reads more than its own); ``--check`` rewrites nothing and
exits 1 naming every block that differs (a test runs it). No number in those blocks is typed by hand.

Loss intervals are 95 % over training runs and held-out text together (``dofla.report.crossed_interval``):
each arm's runs are its data orders (``seed``), every run is scored on the same held-out sequences and
passkey prompts, and a comparison pairs two arms by data order and by sequence. Shares (passkey prompts,
MQAR queries) get Wilson's interval over the pooled trials, and two arms' shares Newcombe's paired interval
with McNemar's exact p (``dofla.report.shares``).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from dofla.report import RunRecord, frontier_plot, frontier_points, frontier_table, load_records
from studies.budget import budget, plan_figure
from studies.dof_tables import dof_allocation
from studies.dof_tokens import dof_tokens, tokens_curve, tokens_figure
from studies.tables import arm, common_orders, markdown, paired, passkey, quality, share_cell, signed, values
from studies.window_memory import restated, window_memory_table

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results" / "runs"
BLOCK = re.compile(r"(<!-- results: (\S+) (\S+) -->\n)(.*?)(<!-- /results -->)", re.S)


def arm_row(label: str, preset: str, runs: list[RunRecord]) -> list[str]:
    """One student's row of the main table."""
    ppl, delta, far = quality(runs)
    return [label, f"`{preset}`", str(len(runs)), f"{ppl:.2f}", f"{math.exp(delta.mean):.2f}×", signed(delta), far,
            passkey(runs, 1024), passkey(runs, 2048)]



HEADLINE = (  # (label, preset), in the order of the tables
    ("window 64 + 4 sinks", "window_sinks_kl"),
    ("pure linear: Hedgehog + decay gate", "linear_hedgehog_kl"),
    ("hybrid: window + sinks + gated Hedgehog", "hybrid_text"),
    ("recall hybrid: + 6 exact copying layers", "hybrid_recall"),
    ("control: the hybrid trained on the recall hybrid's copy text", "hybrid_copy"),
    ("pure linear: gated delta rule", "linear_delta_kl"),
    ("hybrid: window + sinks + gated delta", "hybrid_delta"),
)
COMPARISONS = (  # (what, arm A, arm B, A's per-sequence values, B's (None: the same))
    ("hybrid − window + sinks, held-out loss (nats)", "hybrid_text", "window_sinks_kl", "heldout/student", None),
    ("hybrid − window + sinks, loss at positions 1,024–2,047", "hybrid_text", "window_sinks_kl",
     "position/student/1024-2048", None),
    ("hybrid without its linear part − hybrid, held-out loss", "hybrid_text", "hybrid_text", "ablate/student",
     "heldout/student"),
    ("recall hybrid − window + sinks, held-out loss", "hybrid_recall", "window_sinks_kl", "heldout/student", None),
    ("recall hybrid − window + sinks, passkey @ 1K (share of prompts)", "hybrid_recall", "window_sinks_kl",
     "passkey/student/T1024", None),
    ("recall hybrid − hybrid, passkey @ 1K (share of prompts)", "hybrid_recall", "hybrid_text",
     "passkey/student/T1024", None),
    ("recall hybrid − copy-text control, passkey @ 1K: what the exact layers give", "hybrid_recall", "hybrid_copy",
     "passkey/student/T1024", None),
    ("recall hybrid − copy-text control, passkey @ 2K", "hybrid_recall", "hybrid_copy", "passkey/student/T2048", None),
    ("recall hybrid − copy-text control, held-out loss", "hybrid_recall", "hybrid_copy", "heldout/student", None),
    ("copy-text control − hybrid, passkey @ 1K: what copy training gives", "hybrid_copy", "hybrid_text",
     "passkey/student/T1024", None),
    ("pure linear − window + sinks, held-out loss", "linear_hedgehog_kl", "window_sinks_kl", "heldout/student", None),
    ("gated delta − additive (Hedgehog + gate), held-out loss", "linear_delta_kl", "linear_hedgehog_kl",
     "heldout/student", None),
    ("gated delta − additive, loss at positions 1,024–2,047", "linear_delta_kl", "linear_hedgehog_kl",
     "position/student/1024-2048", None),
    ("gated delta − additive, passkey @ 1K (share of prompts)", "linear_delta_kl", "linear_hedgehog_kl",
     "passkey/student/T1024", None),
    ("delta hybrid − additive hybrid, held-out loss", "hybrid_delta", "hybrid_text", "heldout/student", None),
    ("delta hybrid − window + sinks, loss at positions 1,024–2,047", "hybrid_delta", "window_sinks_kl",
     "position/student/1024-2048", None),
)
TEACHER = "teacher (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to fp32)"
MAIN_HEADER = ["student", "preset", "runs", "held-out ppl", "× teacher", "loss − teacher (nats)",
               "at positions 1,024–2,047", "passkey @ 1K", "passkey @ 2K"]


def teacher_row(records: list[RunRecord]) -> list[str]:
    """The teacher's row: its scores are the same in every run (the same text and prompts), so each comes
    from the first run that measured it (only some presets measure passkey at 2K): the frontier's teacher point."""
    point = frontier_points([r for r in records if "heldout/student" in r.sequences])[0]
    rates = {}
    for length in (1024, 2048):
        name = f"passkey/teacher/T{length}"
        rates[length] = share_cell([r for r in records if name in r.sequences][:1], name)
    return [TEACHER, "–", "–", f"{math.exp(point['loss'].mean):.2f}", "1.00×", "–", "–", rates[1024], rates[2048]]


def headline(records: list[RunRecord], policies: list[RunRecord] = (),
             allocated: list[RunRecord] = ()) -> dict[tuple[str, str], str]:
    """The headline page's blocks (and README's), from the records of the headline presets; empty
    blocks while no run is recorded. ``policies``: the DoF page's records (a preset under another
    allocation policy) and ``allocated``: the budget page's dev records (a student per budget), which
    join the frontier as points of their own."""
    if not records:
        return {("headline", "main"): "", ("headline", "comparisons"): "", ("headline", "orders"): "",
                ("headline", "frontier"): "", ("headline", "window_memory"): "", ("README", "table"): ""}
    arms = [(label, preset, arm(records, preset)) for label, preset in HEADLINE]
    arms = [(label, preset, runs) for label, preset, runs in arms if runs]
    table = [teacher_row(records)] + [arm_row(*a) for a in arms]
    main = markdown(MAIN_HEADER, table)
    found = {preset: runs for _, preset, runs in arms}
    rows = [[what, ", ".join(map(str, common_orders(found[a], found[b]))), paired(found[a], found[b], name, other)]
            for what, a, b, name, other in COMPARISONS if a in found and b in found]
    readme = markdown(["student", "preset", "runs", "held-out ppl", "× teacher", "passkey @ 1K"],
                      [[r[0], r[1], r[2], r[3], r[4], r[7]] for r in table])
    usable = [restated(r) for r in [*records, *policies, *allocated] if "heldout/student" in r.sequences]
    frontier = frontier_table(frontier_points(usable)) if usable else "No run has been recorded.\n"
    return {("headline", "main"): main, ("headline", "comparisons"): markdown(["comparison", "data orders", "A − B"], rows),
            ("headline", "orders"): orders_table(arms), ("headline", "frontier"): frontier,
            ("headline", "window_memory"): window_memory_table([*records, *allocated]), ("README", "table"): readme}


def orders_table(arms: list[tuple[str, str, list[RunRecord]]]) -> str:
    """Each run of a student with several: its held-out perplexity and its mean loss at positions 1,024–2,047
    (the teacher's on the same text beside it), so a pooled interval's spread can be read order by order."""
    rows = []
    for label, preset, runs in arms:
        for run in runs if len(runs) > 1 else []:
            far = [values([run], f"position/{who}/1024-2048") for who in ("student", "teacher")]
            cells = [f"{t.mean().item():.2f}" if t is not None else "–" for t in far]
            rows.append([label, str(run.seed), f"{math.exp(values([run], 'heldout/student').mean().item()):.2f}", *cells])
    header = ["student", "data order", "held-out ppl", "loss at positions 1,024–2,047 (nats)", "teacher's there"]
    return markdown(header, rows) if rows else ""


def headline_rerun(reruns: list[RunRecord], recorded: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The reproduction check: each preset rerun from a fresh clone into a fresh run directory against the
    headline record of the same preset and data order, paired over the held-out sequences."""
    rows = []
    for again in sorted(reruns, key=lambda r: (r.experiment, r.seed)):
        (first,) = [r for r in recorded if r.experiment == again.experiment and r.seed == again.seed] or [None]
        if first is None:
            continue
        a, b = values([again], "heldout/student"), values([first], "heldout/student")
        rows.append([f"`{again.experiment}`", str(again.seed), f"{math.exp(b.mean().item()):.2f}",
                     f"{math.exp(a.mean().item()):.2f}", f"{(a - b).mean().item():+.4f}", f"{(a - b).abs().max().item():.4f}"])
    header = ["preset", "data order", "held-out ppl, record", "held-out ppl, rerun", "rerun − record (nats)",
              "largest difference on one sequence (nats)"]
    return {("headline_rerun", "table"): markdown(header, rows) if rows else ""}


def threads(records: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The same config and data order run with different thread counts (run.json's ``threads``): each run
    against the one with the fewest threads, paired over the held-out sequences, the student's and the
    teacher's (the teacher's moves only with the evaluation's arithmetic, the student's with its training's too)."""
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        if r.threads and "heldout/student" in r.sequences:
            groups.setdefault((r.experiment or "default", r.seed), []).append(r)
    rows = []
    for (experiment, seed), runs in sorted(groups.items()):
        base, *others = sorted(runs, key=lambda r: r.threads)
        for other in others:
            diff = {who: values([other], f"heldout/{who}") - values([base], f"heldout/{who}")
                    for who in ("student", "teacher")}
            rows.append([f"`{experiment}`", str(seed), f"{base.threads} → {other.threads}",
                         f"{math.exp(values([base], 'heldout/student').mean().item()):.2f}",
                         f"{math.exp(values([other], 'heldout/student').mean().item()):.2f}",
                         f"{diff['student'].mean().item():+.4f}", f"{diff['student'].abs().max().item():.4f}",
                         f"{diff['teacher'].abs().max().item():.4f}"])
    header = ["config", "data order", "threads", "held-out ppl, fewer threads", "held-out ppl, more threads",
              "student: more − fewer (nats)", "student: largest difference on one sequence (nats)",
              "teacher: largest difference on one sequence (nats)"]
    return {("threads", "table"): markdown(header, rows) if rows else ""}


MQAR = (("pure linear: gated delta rule", "linear_delta_kl"), ("pure linear: Hedgehog + decay gate", "linear_hedgehog_kl"))


def mqar(records: list[RunRecord]) -> dict[tuple[str, str], str]:
    """The headline page's MQAR block: each student's held-out perplexity and share of queries recalled at
    each length (pooled over its runs and the probe's examples, Wilson's interval), the teacher's, and the
    gated delta student against the additive one, paired by data order and query."""
    lengths = sorted({int(k.rsplit("T", 1)[1]) for r in records for k in r.sequences if k.startswith("mqar/student/")})
    if not lengths:
        return {("headline", "table"): ""}
    arms = [(label, preset, arm(records, preset)) for label, preset in MQAR]
    arms = [(label, preset, runs) for label, preset, runs in arms if runs]
    first = arms[0][2][:1]

    def ppl(runs: list[RunRecord], who: str) -> str:
        loss = values(runs, f"heldout/{who}")
        return "–" if loss is None else f"{math.exp(loss.mean().item()):.2f}"

    rows = [[TEACHER, "–", ppl(first, "teacher"), *[share_cell(first, f"mqar/teacher/T{t}") for t in lengths]]]
    rows += [[label, str(len(runs)), ppl(runs, "student"), *[share_cell(runs, f"mqar/student/T{t}") for t in lengths]]
             for label, _, runs in arms]
    if len(arms) == 2:
        (_, _, a), (_, _, b) = arms
        rows.append(["gated delta − additive (paired)", ", ".join(map(str, common_orders(a, b))), "–",
                     *[paired(a, b, f"mqar/student/T{t}") for t in lengths]])
    header = ["student", "runs", "held-out ppl", *[f"T = {t} ({t // 4} pairs)" for t in lengths]]
    return {("headline", "table"): markdown(header, rows)}


# Each page's builder takes the records of each directory its SOURCES names under docs/results/runs/
# (default: the page's own), in that order; PAGE_FILES: a page whose blocks live in another page's file.
PAGES = {"headline": headline, "dof_allocation": dof_allocation, "headline_rerun": headline_rerun, "mqar": mqar,
         "threads": threads,
         "dof_tokens": dof_tokens, "tokens_curve": tokens_curve, "budget": budget}
SOURCES = {"headline": ("headline", "dof_allocation", "budget"), "dof_allocation": ("dof_allocation", "headline", "algorithm1"),
           "headline_rerun": ("headline_rerun", "headline"), "threads": ("threads",),
           "dof_tokens": ("dof_tokens", "dof_tokens_test", "headline", "dof_allocation"),
           "tokens_curve": ("dof_tokens", "headline"),
           "budget": ("budget_test", "budget", "headline", "budget_alloc", "budget_ablations_test", "budget_ablations",
                      "dof_tokens_test", "budget_retrained_test")}
PAGE_FILES = {"headline_rerun": "headline", "threads": "headline", "mqar": "headline", "dof_tokens": "dof_allocation", "tokens_curve": "headline"}


def frontier_figure(records: list[RunRecord], path: Path) -> Path | None:
    """Held-out loss and passkey recall against decode memory (as the current code holds it:
    :func:`studies.window_memory.restated`), one point per preset and the teacher; None while no recorded run
    measured its decode memory."""
    usable = [restated(r) for r in records if "heldout/student" in r.sequences]
    points = frontier_points(usable) if usable else []
    if not any(p["memory"] for p in points):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return frontier_plot(points, path)


FIGURE_DIR = ROOT / "docs" / "results" / "figures"
# A page's figure and how it is drawn from the page's records whenever its blocks are rewritten (README shows
# the frontier too); the drawing returns None while the records cannot make it.
FIGURES = {"headline": (FIGURE_DIR / "headline_frontier.png", frontier_figure),
           "tokens_curve": (FIGURE_DIR / "tokens_curve.png", tokens_figure),
           "budget": (FIGURE_DIR / "budget_plan.png", plan_figure)}


def page_path(name: str) -> Path:
    return ROOT / "README.md" if name == "README" else ROOT / "docs" / "results" / f"{name}.md"


def rewrite(text: str, page: str, blocks: dict[tuple[str, str], str], file: str) -> tuple[str, list[str]]:
    """``text`` with every block of ``page`` replaced; the names of blocks whose content changed."""
    changed = []

    def replace(match):
        if match.group(2) != page:
            return match.group(0)
        new = blocks.get((file, match.group(3)))
        if new is None:
            raise SystemExit(f"{file} has a block {page} {match.group(3)} that studies.results does not build")
        if new != match.group(4):
            changed.append(f"{file}: {page} {match.group(3)}")
        return match.group(1) + new + match.group(5)

    return BLOCK.sub(replace, text), changed


def sources_of(page: str, records_root: Path = RECORDS) -> list[list[RunRecord]]:
    """The records of each directory ``page`` reads (SOURCES), in order; [] for one not there yet."""
    roots = [records_root / source for source in SOURCES.get(page, (page,))]
    return [load_records(root) if root.is_dir() else [] for root in roots]


def run(page: str, check: bool, records_root: Path = RECORDS) -> list[str]:
    """Rewrite (or with ``check`` only compare) every block of ``page``; returns the blocks that differ."""
    sources = sources_of(page, records_root)
    blocks = PAGES[page](*sources)
    differ = []
    for file in sorted({f for f, _ in blocks}):
        path = page_path(file if file == "README" else PAGE_FILES.get(page, page))
        text, changed = rewrite(path.read_text(), page, blocks, file)
        differ += changed + [f"{file}: {page} {name} (no such block in {path.name})" for f, name in blocks
                             if f == file and blocks[f, name] and f"<!-- results: {page} {name} -->" not in text]
        if not check and changed:
            path.write_text(text)
    if not check and page in FIGURES and (differ or not FIGURES[page][0].exists()):
        path, draw = FIGURES[page]
        draw([r for source in sources for r in source], path)
    return differ


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.results", description=__doc__.splitlines()[0])
    parser.add_argument("page", choices=sorted(PAGES))
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a block differs")
    args = parser.parse_args(argv)
    differ = run(args.page, args.check)
    for block in differ:
        print(("differs: " if args.check else "rewrote: ") + block)
    if args.check and differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
