"""Fault injection for the kill-and-resume tests: a real SIGKILL at a named point.

Setting ``DOFLA_KILL_AT=<point>`` (e.g. ``dof:layer1``, ``train:layer1:step4``) makes the process
kill itself with SIGKILL when it reaches that point: no exception handler, no cleanup, exactly
what a preempted job sees. Unset (always, outside tests) it costs one dict lookup.
"""
from __future__ import annotations

import os
import signal


def kill_point(point: str) -> None:
    """SIGKILL this process if ``DOFLA_KILL_AT`` names ``point``."""
    if os.environ.get("DOFLA_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)
