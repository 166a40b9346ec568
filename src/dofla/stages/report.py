"""The report stage: timings and metrics to the tracker, report.md / report.csv and plots, the summary."""
from __future__ import annotations

import io

from rich.console import Console

from dofla.feature_maps.blocks import layer_mean_dim, mean_dim
from dofla.record import read_json, write_json
from dofla.report import print_run_summary, write_report
from dofla.stages.context import RunContext, StageTimer
from dofla.stages.results import DofResult


def run(ctx: RunContext, metrics: dict, timer: StageTimer, tracker) -> None:
    """Write timings.json, the report and plots (``report`` in the plan), log them, print the summary."""
    out_dir = ctx.out_dir
    timings = read_json(out_dir / "timings.json") or {}
    timings.update({f"time/{k}": v for k, v in timer.seconds.items()})
    write_json(out_dir / "timings.json", timings)
    tracker.log({**metrics, **timings})
    if "report" in ctx.plan:
        write_report(out_dir, console=Console(file=io.StringIO()))
        for plot in sorted(out_dir.glob("*.png")):
            tracker.log_image(plot.stem, plot)
    print_run_summary(out_dir)


def log_allocation(tracker, dof: DofResult | None, dims: list) -> None:
    """The dims as scalars; with Algorithm 1's result (None when it did not run), the DoF per layer
    and the (layer, head, dof, dim) table."""
    tracker.log({"allocation/mean_dim": mean_dim(dims),
                 **{f"allocation/dim/layer_{i:02d}": layer_mean_dim(d) for i, d in enumerate(dims)}})
    if dof is None:
        return
    tracker.log({f"dof/layer_{i:02d}": n for i, n in enumerate(dof.layer_dof) if n is not None})
    tracker.log_table("dof_table", ["layer", "head", "dof", "dim"], [
        [i, h, n, d if isinstance(d, int) else d[h]]
        for i, (heads, d) in enumerate(zip(dof.per_head, dims)) for h, n in enumerate(heads or [])])


def log_training(tracker, summaries: dict) -> None:
    """Per-layer held-out losses as scalars; every layer's training curve as one table."""
    for i, summary in sorted(summaries.items()):
        tracker.log({f"train/layer_{i:02d}/{k}": v for k, v in summary.items() if k.endswith("loss")})
    tracker.log_table("train_curves", ["layer", "step", "loss", "heldout_loss"], [
        [i, point["step"], point.get("loss"), point.get("heldout_loss")]
        for i, summary in sorted(summaries.items()) for point in summary.get("curve", [])])
