"""The allocator setting dofla's commands make (dofla.runtime), observed in fresh processes: whether a
64 MiB tensor is served by a separate mmap (returned to the kernel when freed) or from the heap."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dofla.runtime import mmapped_bytes

pytestmark = pytest.mark.skipif(mmapped_bytes() is None, reason="needs glibc ≥ 2.33 (mallinfo2)")

# prints whether the setting took, then the bytes glibc holds in mmapped blocks while a 64 MiB tensor lives
PROBE = """
import torch
from dofla.runtime import keep_freed_memory, mmapped_bytes
{setup}
x = torch.ones(16 * 2**20)
print(took, mmapped_bytes())
"""
MIB64 = 64 * 2**20


def probe(setup: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if k != "DOFLA_KEEP_FREED_MEMORY"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True,
                         check=True, env={**environment, **env})
    took, held = out.stdout.splitlines()[-1].split()  # the last line: a command may print before it
    return took, int(held)


def test_without_the_setting_a_large_tensor_is_a_separate_mapping():
    took, held = probe("took = None")
    assert held >= MIB64


def test_keep_freed_memory_serves_large_tensors_from_the_heap():
    took, held = probe("took = keep_freed_memory()")
    assert took == "True"
    assert held < MIB64


def test_the_environment_variable_turns_it_off():
    took, held = probe("took = keep_freed_memory()", DOFLA_KEEP_FREED_MEMORY="0")
    assert took == "False"
    assert held >= MIB64


@pytest.mark.slow
def test_the_commands_set_it_before_their_work():
    """dofla-report's entry point (the lightest command) leaves the setting in force."""
    took, held = probe("from dofla.cli import report_main\nreport_main(['--help'])\ntook = 'True'")
    assert held < MIB64
