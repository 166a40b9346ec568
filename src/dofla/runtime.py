"""Process-wide settings dofla's commands make before any work: the C allocator keeps freed memory.

glibc's malloc serves every block above its mmap threshold (at most 32 MiB, raised on its own as
blocks are freed) with a fresh ``mmap`` and returns it to the kernel on ``free``. A tensor of one
layer's queries at 16K tokens (9 heads × 64 × fp32) is 38 MiB, so each such temporary costs page
faults on first touch: on a 2-core CPU, 10 ms to allocate and fill 38 MiB, against 3 ms from memory
malloc already holds; a (9, 16384, 64) @ (9, 64, 64) product took 17 ms into a new tensor and 7 ms
into a reused one. Raising the threshold to 1 GiB keeps freed blocks in the heap for the next
tensor of that size. The numbers computed are the same; the cost is that the process's resident
memory stays near its peak instead of falling back between steps (it never goes above it).

``dofla``, ``dofla-eval``, ``dofla-prepare``, ``dofla-report`` and the benchmarks call
:func:`keep_freed_memory` at start; a script that imports dofla can call it too.
``DOFLA_KEEP_FREED_MEMORY=0`` leaves the allocator as it is. On other C libraries (macOS, musl,
Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from (and go back to) the heap
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


def keep_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Raise glibc's mmap threshold to ``threshold`` bytes for the rest of the process (see the
    module docstring). Returns whether the setting is now in force: False under
    ``DOFLA_KEEP_FREED_MEMORY=0``, on another C library, or if glibc refused the value."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(min(threshold, 2**31 - 1))))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mmapped_bytes() -> int | None:
    """Bytes glibc currently holds in separately mmapped blocks (``mallinfo2().hblkhd``), or None
    where that cannot be read (another C library, glibc before 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().hblkhd)
