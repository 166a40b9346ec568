"""``attention.chunk_size=auto``: the chunk size of the linear kernel that is fastest on this machine,
measured once and remembered.

The chunked kernel's speed depends on the chunk through matmul shapes and the per-chunk Python
work, and which chunk wins differs between CPUs (and GPUs). ``auto`` times the kernel's forward at
each candidate on random inputs of the student's shape (heads, features, value dim) and keeps the
fastest; the answer is stored in ``chunk_size.json`` under dofla's cache directory, keyed by the
device, torch's version and thread count, and the shape, so every later run on this machine reads it
instead of measuring. The chunk size changes the speed only: every chunk gives the same outputs up
to float rounding (``tests/unit/test_attention.py``).
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from dofla.attention.linear import linear_attention_chunked
from dofla.record import read_json, write_json

CANDIDATES = (32, 64, 128, 256)
FILE = "chunk_size.json"


def device_name(device: torch.device) -> str:
    """A name for the hardware: the GPU's, or the CPU model's (from /proc/cpuinfo where it exists)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tuning_key(device: torch.device, heads: int, features: int, value_dim: int, length: int) -> str:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return (f"{device_name(device)} | torch {torch.__version__} | threads {threads} | "
            f"H {heads} M {features} dv {value_dim} T {length}")


@torch.no_grad()
def measure(heads: int, features: int, value_dim: int, device: torch.device, length: int = 2048,
            candidates=CANDIDATES, repeats: int = 3) -> dict[int, float]:
    """Seconds per forward of the chunked kernel (best of ``repeats`` after one warm-up) at each
    candidate chunk size, on one sequence of ``length`` random tokens."""
    g = torch.Generator().manual_seed(0)
    log_q, log_k = (torch.randn(1, heads, length, features, generator=g).to(device) for _ in range(2))
    v = torch.randn(1, heads, length, value_dim, generator=g).to(device)
    seconds = {}
    for chunk in candidates:
        times = []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            linear_attention_chunked(log_q, log_k, v, chunk_size=chunk)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds[chunk] = min(times[1:])
    return seconds


def best_chunk_size(heads: int, features: int, value_dim: int, device: torch.device, cache_dir: Path,
                    length: int = 2048) -> int:
    """The fastest candidate for this shape on this machine: read from ``cache_dir/chunk_size.json``,
    or measured now (a second or so) and written there."""
    path = Path(cache_dir) / FILE
    key = tuning_key(device, heads, features, value_dim, length)
    known = read_json(path)
    known = known if isinstance(known, dict) else {}  # missing or unreadable: measured and rewritten
    if key in known:
        return int(known[key]["chunk_size"])
    seconds = measure(heads, features, value_dim, device, length)
    best = min(seconds, key=seconds.get)
    # full precision: a rounded record could tie where the measurement did not, and disagree with its own choice
    known[key] = {"chunk_size": best, "seconds": {str(c): s for c, s in seconds.items()}}
    write_json(path, known)
    return best
