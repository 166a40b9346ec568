"""The allocator setting dofla's commands make (dofla.runtime), observed in fresh processes: whether a
64 MiB tensor is served by a separate mmap, and whether the heap keeps a freed one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dofla.runtime import malloc_bytes

pytestmark = pytest.mark.skipif(malloc_bytes() is None, reason="needs glibc ≥ 2.33 (mallinfo2)")

# prints (as its last line) whether the setting took and how glibc's mapped blocks and heap grew from
# before a 64 MiB tensor to while it lives, and to after it is freed
PROBE = """
import json, torch
from dofla.runtime import keep_freed_memory, malloc_bytes
{setup}
before = malloc_bytes()
x = torch.ones(16 * 2**20)
live = malloc_bytes()
del x
freed = malloc_bytes()
grew = lambda now: {{k: now[k] - before[k] for k in now}}
print(json.dumps({{"took": took, "live": grew(live), "freed": grew(freed)}}))
"""
MIB64 = 64 * 2**20
MOST, LITTLE = 0.9 * MIB64, 0.1 * MIB64  # "holds the tensor" (free space it reused aside), "gave it back"


def probe(setup: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "DOFLA_KEEP_FREED_MEMORY"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True,
                         check=True, env={**environment, **env})
    return json.loads(out.stdout.splitlines()[-1])  # the last line: a command may print before it


def test_without_the_setting_a_large_tensor_is_a_separate_mapping():
    seen = probe("took = None")
    assert seen["live"]["mmapped"] >= MIB64
    assert seen["freed"]["mmapped"] < LITTLE and seen["freed"]["heap"] < LITTLE  # given back


def test_keep_freed_memory_serves_large_tensors_from_the_heap_and_keeps_them():
    seen = probe("took = keep_freed_memory()")
    assert seen["took"] is True
    assert seen["live"]["mmapped"] < LITTLE and seen["live"]["heap"] >= MOST
    assert seen["freed"]["heap"] >= MOST  # freed at the heap's top, and not trimmed


def test_the_environment_variable_turns_it_off():
    seen = probe("took = keep_freed_memory()", DOFLA_KEEP_FREED_MEMORY="0")
    assert seen["took"] is False
    assert seen["live"]["mmapped"] >= MIB64


@pytest.mark.slow
def test_the_commands_set_it_before_their_work():
    """dofla-report's entry point (the lightest command) leaves the setting in force."""
    seen = probe("from dofla.cli import report_main\nreport_main(['--help'])\ntook = True")
    assert seen["live"]["mmapped"] < LITTLE and seen["freed"]["heap"] >= MOST
