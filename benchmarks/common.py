"""Shared helpers for the benchmarks: threads, timing, FLOP rate, peak memory, result rows.

Every ``bench_*.py`` exposes ``main(argv: list[str] | None = None) -> list[Row]`` and runs on its
own as ``python -m benchmarks.bench_x [flags]``. Benchmarks print tables; they are not tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dofla.runtime import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results.json"
# as the pipeline does: subnormal floats from shifted exponentials are ~100x slower on x86 CPUs
torch.set_flush_denormal(True)
# as dofla's commands do: freed tensors stay with the allocator (dofla.runtime); DOFLA_KEEP_FREED_MEMORY=0 measures
# without, for both sides of every row alike
KEEP_FREED = keep_freed_memory()


@dataclass
class Row:
    what: str
    compared_with: str
    target: str
    measured: str
    ratio: float | None
    ok: bool | None  # None: informational row, no pass/fail
    note: str = ""

    @property
    def status(self) -> str:
        return "n/a" if self.ok is None else ("ok" if self.ok else "MISS")


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: $DOFLA_BENCH_THREADS or all cores). On a busy "
                             "machine use 1: oversubscribed OpenMP barriers make small ops 100x slower")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    return parser


def set_threads(threads: int | None = None) -> int:
    """torch.set_num_threads from the flag, $DOFLA_BENCH_THREADS, or the machine's core count."""
    n = threads or int(os.environ.get("DOFLA_BENCH_THREADS", 0)) or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    os.environ["DOFLA_BENCH_THREADS"] = str(n)  # subprocesses (memory points) use the same
    return n


def timeit(fn, repeats: int = 3, warmup: int = 1, best: bool = False) -> float:
    """Median (or best, ``best=True``) wall seconds of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def paired_ratio(slow, fast, repeats: int) -> tuple[float, float, float, list[float]]:
    """(median seconds of ``slow``, of ``fast``, median ratio slow/fast, sorted ratios) from
    ``repeats`` rounds that run one call of each back to back: on a shared machine whose speed
    drifts between minutes, the pairs see the same machine where two separate medians might not."""
    pairs = []
    for _ in range(max(1, repeats)):
        pairs.append((timeit(slow, repeats=1, warmup=0), timeit(fast, repeats=1, warmup=0)))
    ratios = sorted(a / b for a, b in pairs)
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(ratios), ratios)


def interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall seconds of each of ``fns`` (name -> callable) over ``repeats`` rounds that call every one
    once in turn (after one warm-up call each): round i of every function saw the same minutes."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            times[name].append(timeit(fn, repeats=1, warmup=0))
    return times


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (GFLOP/s), measured now (best of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timeit(lambda: a @ b, repeats=repeats, best=True) / 1e9


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth (bytes/s) for a large copy, read plus write, measured now."""
    a = torch.ones(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / timeit(lambda: b.copy_(a), repeats=repeats, best=True)


def _status_mib(field: str) -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def peak_delta_mib(fn) -> float:
    """Peak resident memory above the current level while ``fn()`` runs (MiB).

    Linux: reset the high-water mark (``echo 5 > /proc/self/clear_refs``), run, read VmHWM.
    Elsewhere falls back to ``ru_maxrss`` growth, meaningful only in a fresh process (run it via
    :func:`run_isolated`).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_mib("VmRSS")
        fn()
        return _status_mib("VmHWM") - base
    except (OSError, TypeError):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        fn()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def run_isolated(module: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """``python -m benchmarks.<module> args`` in a fresh process (``env``: more environment variables);
    its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args],
                         capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    load = ", load average %.2f %.2f %.2f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return (f"{cpu_model()}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}{load}"
            f"{', freed memory kept by malloc' if KEEP_FREED else ''}")


def as_row(r) -> Row:
    """Accept a Row, a dict, or any object with Row's fields (rows from other engineers' benches)."""
    if isinstance(r, Row):
        return r
    get = r.get if isinstance(r, dict) else (lambda k, d=None: getattr(r, k, d))
    return Row(str(get("what", "?")), str(get("compared_with", "")), str(get("target", "")),
               str(get("measured", "")), get("ratio"), get("ok"), str(get("note", "") or ""))


def save_rows(name: str, rows: list[Row]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[name] = [asdict(r) for r in rows]
    RESULTS.write_text(json.dumps(data, indent=2))


def _cells(r: Row) -> list[str]:
    ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
    return [r.what, r.compared_with, r.target, r.measured, ratio, r.status + (f" ({r.note})" if r.note else "")]


HEADER = ["what", "compared with", "target", "measured", "ratio", "status"]


def print_rows(rows: list[Row], title: str = "dofla benchmarks") -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        print(title)
        for cells in [HEADER] + [_cells(r) for r in rows]:
            print(" | ".join(cells))
        return
    table = Table(title=title)
    for col in HEADER:
        table.add_column(col)
    for r in rows:
        table.add_row(*_cells(r))
    Console(width=220).print(table)


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = _cells(r)
        if r.ok is False:
            cells[5] = cells[5].replace("MISS", "**MISS**", 1)
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def finish(name: str, rows: list[Row]) -> list[Row]:
    """Save and print a benchmark's rows (the standalone entry points end here)."""
    save_rows(name, rows)
    print_rows(rows, title=f"dofla benchmarks: {name}")
    return rows
