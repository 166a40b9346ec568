"""Table helpers shared by the results pages (:mod:`studies.results`): per-sequence values of a run
record, the 95 % intervals over runs and held-out text (``dofla.report.crossed_interval``) and the binomial
intervals of shares (``dofla.report.shares``) as table cells, and markdown tables."""
from __future__ import annotations

import math

import torch

from dofla.report import Interval, RunRecord, paired_interval
from dofla.report import paired_share_interval, share_interval


def arm(records: list[RunRecord], preset: str) -> list[RunRecord]:
    """The runs of ``preset``, by data order."""
    return sorted((r for r in records if r.experiment == preset), key=lambda r: r.seed)


def values(runs: list[RunRecord], name: str) -> torch.Tensor | None:
    """(runs, sequences) of the per-sequence values ``name`` (e.g. ``heldout/student``); None if a run lacks it."""
    if not runs or any(name not in r.sequences for r in runs):
        return None
    return torch.tensor([r.sequences[name] for r in runs], dtype=torch.float64)


# The teacher's loss on one sequence, scored twice on the same text, agrees to about 1e-4 nats (fp32 sums
# taken in another order on another thread count or allocator); other text differs by tenths of a nat.
SAME_TEXT_NATS = 1e-3


def teacher(runs: list[RunRecord], name: str) -> torch.Tensor | None:
    """The teacher's values ``name`` (``heldout/teacher``...) of each of ``runs``: the same text in every
    run, so the same scores up to fp32 rounding (checked); each run is paired with its own."""
    table = values(runs, name)
    if table is not None and (table - table[:1]).abs().max() > SAME_TEXT_NATS:
        raise SystemExit(f"the runs of {runs[0].experiment} were scored on different {name} text; "
                         "a paired interval needs the same held-out text in every run")
    return table


def bucket(name: str, runs: list[RunRecord], lo: int) -> str | None:
    """The loss-by-position key of ``name`` (teacher/student) whose bucket starts at ``lo``."""
    keys = [k for k in runs[0].sequences if k.startswith(f"position/{name}/{lo}-")] if runs else []
    return keys[0] if keys else None


def _counted(interval, text: str) -> str:
    """``text``, marked when its interval cannot count both runs and text (one run: text only)."""
    return text if interval.counts == "runs and text" or interval.half_width is None else f"{text} ({interval.counts})"


def signed(interval) -> str:
    if interval.half_width is None:
        return f"{interval.mean:+.3f}"
    return _counted(interval, f"{interval.mean:+.3f} ± {interval.half_width:.3f}")


def trials_per_value(name: str) -> int | None:
    """How many trials each per-sequence value of ``name`` counts when it is a share: a passkey prompt is one
    (0 or 1), an MQAR example at length T is T/4 queries; None for a loss."""
    if name.startswith("passkey/"):
        return 1
    if name.startswith("mqar/"):
        return int(name.rsplit("T", 1)[1]) // 4
    return None


def share(table: torch.Tensor, name: str) -> str:
    """The share of hits in ``table`` (runs × prompts or examples of ``name``), its Wilson interval and the count."""
    got = share_interval(table, trials_per_value(name))
    return f"{got} ({got.hits}/{got.trials})"


def share_cell(runs: list[RunRecord], name: str) -> str:
    """The runs' share of ``name`` pooled over runs and trials, or – when not measured."""
    hits = values(runs, name)
    return "–" if hits is None else share(hits, name)


def paired_share(a: torch.Tensor, b: torch.Tensor, name: str) -> str:
    """A − B on the same trials: Newcombe's interval and McNemar's exact p; where the paired cells cannot be
    told from per-example shares, the crossed interval of the per-example differences, marked."""
    got = paired_share_interval(a, b, trials_per_value(name))
    if got is None:
        return f"{signed(paired_interval(a, b))} (per example)"
    return f"{got} (McNemar p = {got.p_value:.2g})"


def gap(runs: list[RunRecord], student: str, reference: str) -> str:
    """Student − teacher on the per-sequence values ``student``/``reference``, or – when not measured."""
    a, b = values(runs, student), teacher(runs, reference)
    return "–" if a is None or b is None else signed(paired_interval(a, b))


def passkey(runs: list[RunRecord], length: int) -> str:
    return share_cell(runs, f"passkey/student/T{length}")


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def common_orders(a: list[RunRecord], b: list[RunRecord]) -> list[int]:
    """The data orders (seeds) both arms ran, in order."""
    return sorted({r.seed for r in a} & {r.seed for r in b})


def paired(a: list[RunRecord], b: list[RunRecord], name: str, b_name: str | None = None) -> str:
    """A − B on ``name`` (B on ``b_name``), paired by data order and sequence over the orders both arms
    ran; – if either lacks the values or they share no order."""
    orders = common_orders(a, b)
    a, b = [r for r in a if r.seed in orders], [r for r in b if r.seed in orders]
    x, y = values(a, name), values(b, b_name or name)
    if not orders or x is None or y is None:
        return "–"
    return paired_share(x, y, name) if trials_per_value(name) else signed(paired_interval(x, y))


def quality(runs: list[RunRecord]) -> tuple[float, Interval, str]:
    """A student's held-out perplexity, its loss − teacher interval, and its gap to the teacher at
    positions 1,024–2,047 as a cell (– when not measured)."""
    loss = values(runs, "heldout/student")
    delta = paired_interval(loss, teacher(runs, "heldout/teacher"))
    far_s, far_t = bucket("student", runs, 1024), bucket("teacher", runs, 1024)
    return math.exp(loss.mean().item()), delta, gap(runs, far_s, far_t) if far_s and far_t else "–"


KINDS = ("exact", "window", "window + state", "state")  # what a menu option keeps, in the plan figure's colours
# what the budget page pairs two students on: (column, per-sequence or per-prompt values)
SIGNALS = (("held-out loss (nats)", "heldout/student"), ("loss at positions 1,024–2,047", "position/student/1024-2048"),
           ("passkey @ 1K (share of prompts)", "passkey/student/T1024"),
           ("passkey @ 2K (share of prompts)", "passkey/student/T2048"))


def kind(option: str) -> str:
    """What a menu option (``dofla.dof.menu.label``) keeps: exact, a window alone, a window and a state, a state."""
    if option == "exact":
        return "exact"
    window, state = option.startswith("w"), any(s in option for s in ("delta", "linear", "gla"))
    return "window + state" if window and state else "window" if window else "state"
