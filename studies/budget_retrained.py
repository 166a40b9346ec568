"""The allocator's plan trained again under the current code (``docs/results/budget.md``).

The window's price and its code changed after the allocated students were trained, and plans solved at the
new price lose passkeys at 2K that the recorded plans recall. Two things changed between those runs: the plan
and the code that trains and scores it. A recorded plan trained again, given whole (``attention.plan``, its
data order and settings as recorded; ``studies/reproduce/budget_retrain.sh``), separates them: against the
recorded run it shows what the code and the training's own variation move with the plan held fixed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dofla.models import StudentPlan
from dofla.report import RunRecord
from studies.tables import SIGNALS, markdown, paired


def recorded_runs(retrained: RunRecord, allocated: list[RunRecord]) -> list[RunRecord]:
    """The allocated runs of the retrained run's data order whose chosen plan is the one it was given (each
    head's fields as the plan reads them, so a plan written with its defaults left out is the same plan)."""
    if retrained.plan is None:
        return []
    return [r for r in allocated if r.seed == retrained.seed and r.allocation and r.allocation.get("plan")
            and StudentPlan.from_list(r.allocation["plan"]).to_list() == retrained.plan]


def retrained_table(retrained: list[RunRecord], allocated: list[RunRecord], name) -> str:
    """A row per retrained run (test) against the recorded run of its plan (test), paired by held-out sequence
    or passkey prompt; ``name`` names a recorded run's budget."""
    rows = []
    for r in sorted(retrained, key=lambda r: r.seed):
        for recorded in recorded_runs(r, allocated):
            rows.append([f"{name(recorded)}, order {r.seed}: trained again − recorded",
                         *[paired([r], [recorded], signal) for _, signal in SIGNALS]])
    header = ["plan (A − B, test)", *[what for what, _ in SIGNALS]]
    return markdown(header, rows) if rows else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.budget_retrained",
                                     description="Write the plan a recorded allocation chose where attention.plan reads it.")
    parser.add_argument("allocation", type=Path, help="a record's allocation.json")
    parser.add_argument("plan", type=Path, help="the plan file to write (JSON)")
    args = parser.parse_args(argv)
    try:
        plan = json.loads(args.allocation.read_text())["plan"]
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"budget_retrained: {args.allocation} holds no chosen plan ({error!r}); give the "
                         "allocation.json of an allocated run's record") from None
    args.plan.parent.mkdir(parents=True, exist_ok=True)
    args.plan.write_text(json.dumps(plan))
    print(f"budget_retrained: {args.allocation} -> {args.plan}")


if __name__ == "__main__":
    main()
