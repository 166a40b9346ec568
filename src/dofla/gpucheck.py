"""``dofla-gpucheck``: what a new GPU machine does with the paper's cells, in minutes, with no hub and no data.

For GPT-2 (L = 1024, C = 64, batch 128) and Pythia-1B (L = 2048, C = 128, batch 64), built from their
configurations with random weights, and for each precision the device supports (fp32, tf32 on CUDA,
bf16), it runs on the device the pipeline's own steps (:mod:`dofla.train.probe_steps`) at the
micro-batch ``auto`` picks there: one distillation step per loss (softmax, l2 streamed; direct end to
end) and one task fine-tune step of the evaluation protocol (rows of 512 tokens). For each it measures
tokens/s, the peak memory beside the memory preflight's prediction, and the host synchronisations a
step makes; it projects the hours of each paper cell and of each sweep; then it runs the ``gpu``-marked
tests. It prints a table, writes everything as JSON (``--out``) and exits non-zero with one sentence
when a check fails: a step raises or returns a non-finite loss, the measured peak exceeds the
prediction by more than ``--tolerance`` (on a GPU), or a ``gpu`` test fails.

On the CPU (or with ``--tiny``) the same checks run at tiny shapes (2 layers, 64 tokens), so the tests
run it for real; its projections are then the tiny models', labelled so.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dofla.gpucheck_cells import CELLS, Cell, check_cell, device_precisions, run_gpu_tests, sweep_hours
from dofla.stages.preflight import size


@dataclass
class Report:
    device: dict
    tiny: bool
    checks: list = field(default_factory=list)
    sweeps: dict = field(default_factory=dict)
    gpu_tests: dict = field(default_factory=dict)
    ok: bool = True
    failure: str | None = None


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                    bf16=torch.cuda.is_bf16_supported())
    else:
        info.update(name="CPU", threads=torch.get_num_threads())
    return info


def first_failure(report: Report) -> str | None:
    """The first failed check, in one sentence."""
    for check in report.checks:
        if check["problem"]:
            return f"{check['teacher']} {check['stage']} ({check['precision']}): {check['problem']}"
    tests = report.gpu_tests
    if tests.get("returncode") not in (None, 0):
        return f"the gpu-marked tests failed: {tests.get('summary')}"
    return None


def table(report: Report) -> str:
    head = ("| teacher | step | precision | micro-batch | tokens/s | projected cell | peak measured / predicted "
            "| host syncs per step |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for c in report.checks:
        measured, predicted = ("–" if c[k] is None else size(c[k])
                               for k in ("measured_peak_bytes", "predicted_peak_bytes"))
        kind = "" if c["measured_kind"] == "cuda" else " (RSS)"
        rows.append(f"| {c['teacher']} | {c['stage']} | {c['precision']} | {c['micro_batch']} of {c['batch']} "
                    f"| {c['tokens_per_s']:,.0f} | {c['projected_cell_hours']:.2f} h | {measured}{kind} / {predicted} "
                    f"| {c['host_syncs_per_step']} |")
    sweeps = "\n".join(f"- {name}, {precision}: the sweep ≈ {hours:.1f} h on this device"
                       for name, per in report.sweeps.items() for precision, hours in per.items())
    return "\n".join([head, *rows]) + "\n\n" + sweeps


def run(tiny: bool | None = None, precisions: list[str] | None = None, tests: bool = True,
        tolerance: float = 0.25, teachers: list[str] | None = None, limit: int | None = None) -> Report:
    """Every check (``tiny``: None picks tiny shapes on the CPU; ``limit``: bytes to plan against
    instead of the device's); the report, failures included."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = device.type == "cpu" if tiny is None else tiny
    report = Report(device_info(device), tiny)
    chosen = [c for c in CELLS if teachers is None or c.teacher in teachers]
    for precision in precisions or device_precisions(device):
        for cell in chosen:
            report.checks.append(asdict(check_cell(cell, precision, device, tiny, tolerance, limit)))
    report.sweeps = sweep_hours(report.checks)
    if tests:
        report.gpu_tests = run_gpu_tests()
    report.failure = first_failure(report)
    report.ok = report.failure is None
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dofla-gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpucheck.json"),
                        help="the JSON report (default ./gpucheck.json)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes even on a GPU (automatic on the CPU)")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated, of fp32,tf32,bf16 (default: all the device supports)")
    parser.add_argument("--teachers", default=None, help="comma-separated, of gpt2,pythia-1b (default both)")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="plan the micro-batches against this many GiB instead of the device's memory")
    parser.add_argument("--tolerance", type=float, default=0.25,
                        help="how far a measured GPU peak may exceed the prediction (default 0.25: 25 %%)")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",") if args.precisions else None
    teachers = args.teachers.split(",") if args.teachers else None
    if precisions and not set(precisions) <= {"fp32", "tf32", "bf16"} or \
            teachers and not set(teachers) <= {c.teacher for c in CELLS}:
        parser.error("--precisions from fp32,tf32,bf16; --teachers from gpt2,pythia-1b")
    limit = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else None
    report = run(True if args.tiny else None, precisions, not args.no_tests, args.tolerance, teachers, limit)
    print(f"dofla-gpucheck on {report.device['name']}" + (" (tiny shapes)" if report.tiny else ""))
    print(table(report))
    args.out.write_text(json.dumps(asdict(report), indent=1, default=lambda v: None if isinstance(v, float)
                                   and not math.isfinite(v) else str(v)) + "\n")
    print(f"written to {args.out}")
    if not report.ok:
        print(f"dofla-gpucheck failed: {report.failure}", file=sys.stderr)
        return 1
    return 0


__all__ = ["Cell", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
