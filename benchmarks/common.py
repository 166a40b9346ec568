"""Shared helpers for the benchmarks: timing, FLOP rate of the machine, result rows."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results.json"


@dataclass
class Row:
    what: str
    compared_with: str
    target: str
    measured: str
    ratio: float | None
    ok: bool | None
    note: str = ""


def timeit(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(n: int = 2048) -> float:
    """This machine's fp32 matmul rate (GFLOP/s), measured now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timeit(lambda: a @ b, repeats=5) / 1e9


def peak_rss_during(fn) -> float:
    """Peak resident memory (MiB) above the level before ``fn()``, sampled every millisecond."""
    import threading

    import psutil

    process = psutil.Process()
    base = process.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    fn()
    done.set()
    thread.join()
    return (max(peak[0], process.memory_info().rss) - base) / 2**20


def run_isolated(module: str, *args: str) -> dict:
    """Run ``python -m benchmarks.<module> --json args`` in a fresh process (for peak memory)."""
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--json", *args],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}")


def save_rows(name: str, rows: list[Row]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[name] = [asdict(r) for r in rows]
    RESULTS.write_text(json.dumps(data, indent=2))


def print_rows(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dofla benchmarks")
    for col in ("what", "compared with", "target", "measured", "ratio", "status"):
        table.add_column(col)
    for r in rows:
        status = "n/a" if r.ok is None else ("ok" if r.ok else "MISS")
        table.add_row(r.what, r.compared_with, r.target, r.measured,
                      "" if r.ratio is None else f"{r.ratio:.2f}", status + (f" ({r.note})" if r.note else ""))
    Console(width=200).print(table)
