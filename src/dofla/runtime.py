"""Process-wide settings dofla's commands make before any work: the C allocator keeps freed memory.

glibc's malloc serves every block above its mmap threshold (at most 32 MiB, raised on its own as
blocks are freed) with a fresh ``mmap`` and unmaps it on ``free``; a block it serves from the heap
goes back to the kernel too when it is freed at the heap's top (above the trim threshold). Either
way the next tensor of that size page-faults its memory in again. One layer's queries at 16K tokens
(9 heads × 64, fp32) are 38 MiB: a (9, 16384, 64) @ (9, 64, 64) product took 15 ms into fresh memory
and 5 ms into memory malloc still held, on the 2-core CPU of ``docs/benchmarks.md``. Raising the
mmap threshold to 1 GiB and the trim threshold to 2 GiB keeps freed blocks for the next tensor: the
student's whole-model prefill at 16K went from 27 s to 17 s there. The numbers computed are the
same; the process's resident memory stays near its peak instead of falling back between steps (it
never goes above it).

``dofla``, ``dofla-eval``, ``dofla-prepare``, ``dofla-report``, the benchmarks and the tests call
:func:`keep_freed_memory` at start; a script that imports dofla can call it too.
``DOFLA_KEEP_FREED_MEMORY=0`` leaves the allocator as it is. On other C libraries (macOS, musl,
Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from (and go back to) the heap
TRIM_THRESHOLD = (1 << 31) - 1  # the heap's free top is returned to the kernel only above 2 GiB
ENV = "DOFLA_KEEP_FREED_MEMORY"


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(threshold: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap threshold to ``threshold`` bytes and its trim threshold to ``trim`` for the
    rest of the process (see the module docstring). Returns whether the setting is now in force:
    False under ``DOFLA_KEEP_FREED_MEMORY=0``, on another C library, or if glibc refused a value."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(min(threshold, 2**31 - 1)))
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(min(trim, 2**31 - 1)))
    return bool(mmap_ok and trim_ok)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_bytes() -> dict[str, int] | None:
    """What glibc holds now: ``mmapped``, bytes in separately mapped blocks (``mallinfo2().hblkhd``),
    and ``heap``, the heap's size (``arena``, freed blocks included); None where that cannot be read
    (another C library, glibc before 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"mmapped": int(info.hblkhd), "heap": int(info.arena)}
