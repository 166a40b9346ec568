"""What a run measures about itself, beside what the preflight predicted: each stage's peak memory
and its training step time (``resources/<stage>/...`` in metrics.json).

Peak memory is the CUDA caching allocator's ``max_memory_allocated`` on a GPU, reset when a stage
starts (:func:`peak_memory`; nested scopes keep the outer one's peak whole): tensor storage, the same
quantity the preflight predicts. On the CPU it is the peak resident set size: on Linux the kernel's
high-water mark (``VmHWM``), reset when a stage starts (``/proc/self/clear_refs``), so a stage's value
is its own peak, from the resident set it started with; where that cannot be reset (another OS, a
kernel that refuses) the process's peak so far (``getrusage``), which only grows over a process's life.
Either includes the interpreter, the libraries, whatever earlier stages left loaded and memory malloc
keeps after freeing, which the prediction does not; so a resettable scope also keeps the resident set
it started with (``start``). The block's own use lies between its growth above that (the peak less
``start``, which leaves out memory reused from what malloc kept) and its peak.

Step time is read from the live logs the trainers send every ``log_every`` steps (:class:`StepClock`):
the wall time between two log points over the steps between them, so it includes the host
synchronisation each log point makes and leaves out whatever runs before the first one (compilation,
warm-up).
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from pathlib import Path

import torch

_OUTER: list[list[int]] = []  # the running peak of every enclosing CUDA scope
_OUTER_RSS: list[list[int]] = []  # the running peak of every enclosing resettable CPU scope
_PROC = Path("/proc/self")


def rss_peak() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_high_water() -> int | None:
    """The kernel's resident-set high-water mark since it was last reset (``VmHWM``), in bytes; None
    where /proc does not give it."""
    return _status_bytes("VmHWM:")


def _status_bytes(field: str) -> int | None:
    try:
        for line in (_PROC / "status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_now() -> int | None:
    """This process's resident set now (``VmRSS``), in bytes; None where /proc does not give it."""
    return _status_bytes("VmRSS:")


def reset_rss_high_water() -> bool:
    """Resets ``VmHWM`` to the current resident set (Linux ≥ 4.0); False where that is refused."""
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def peak_memory(device: torch.device | str | None = None):
    """Yields a dict that holds, once the block ends, ``bytes`` (the block's peak) and ``kind``
    (``cuda``: allocated tensor memory; ``rss``: the block's own peak resident set; ``rss_process``:
    the process's peak resident set so far, where the high-water mark cannot be reset); with ``rss``
    also ``start``, the resident set when the block began."""
    out: dict = {}
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        with _rss_scope(out):
            yield out
        return
    torch.cuda.synchronize(device)
    if _OUTER:
        _OUTER[-1][0] = max(_OUTER[-1][0], torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    _OUTER.append([0])
    try:
        yield out
    finally:
        torch.cuda.synchronize(device)
        mine = max(_OUTER.pop()[0], torch.cuda.max_memory_allocated(device))
        if _OUTER:
            _OUTER[-1][0] = max(_OUTER[-1][0], mine)
        out.update(bytes=mine, kind="cuda")


@contextlib.contextmanager
def _rss_scope(out: dict):
    """The CPU side of :func:`peak_memory`: the high-water mark reset on entry (the enclosing scope
    first keeps what it had reached) and read on exit; the process's peak where it cannot be reset."""
    before = rss_high_water()
    if before is None or not reset_rss_high_water():
        try:
            yield
        finally:
            out.update(bytes=rss_peak(), kind="rss_process")
        return
    if _OUTER_RSS:
        _OUTER_RSS[-1][0] = max(_OUTER_RSS[-1][0], before)
    start = rss_now() or 0
    _OUTER_RSS.append([0])
    try:
        yield
    finally:
        mine = max(_OUTER_RSS.pop()[0], rss_high_water() or 0)
        if _OUTER_RSS:
            _OUTER_RSS[-1][0] = max(_OUTER_RSS[-1][0], mine)
        out.update(bytes=mine, kind="rss", start=min(start, mine))


class StepClock:
    """A tracker that passes everything on to ``tracker`` and times the training steps it sees logged
    (``<stage>/step`` keys): per stage, the seconds and steps between consecutive log points."""

    def __init__(self, tracker, stages=("train", "distill")):
        self.tracker, self.stages = tracker, stages
        self.last: dict[str, tuple[float, int]] = {}
        self.totals: dict[str, list[float]] = {}  # stage -> [seconds, steps]

    def log(self, values: dict, *args, **kwargs):
        now = time.perf_counter()
        for stage in self.stages:
            step = values.get(f"{stage}/step")
            if step is None:
                continue
            before = self.last.get(stage)
            if before is not None and step > before[1]:  # a new layer starts again from step 0: not counted
                total = self.totals.setdefault(stage, [0.0, 0])
                total[0] += now - before[0]
                total[1] += step - before[1]
            self.last[stage] = (now, step)
        return self.tracker.log(values, *args, **kwargs)

    def step_seconds(self) -> dict[str, float]:
        return {stage: seconds / steps for stage, (seconds, steps) in self.totals.items() if steps}

    def __getattr__(self, name):
        return getattr(self.tracker, name)


@torch.no_grad()
def teacher_tokens_per_second(teacher, seq_len: int) -> float:
    """One timed teacher forward of a (1, seq_len) batch, after a warm-up forward and with the device
    synchronised before and after (a GPU's first call and its asynchronous launch mislead): the
    throughput the predictions use."""
    device = next(teacher.parameters()).device
    ids = torch.randint(0, teacher.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    teacher(input_ids=ids, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    teacher(input_ids=ids, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seq_len / max(time.perf_counter() - start, 1e-9)
