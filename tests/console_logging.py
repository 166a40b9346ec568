"""dofla's messages on the terminal during the in-process tests, as the commands show them: the tests
that read captured stdout see the lines a person sees (dofla.logs.setup_logging)."""
from __future__ import annotations

import pytest

from dofla.logs import setup_logging


@pytest.fixture(autouse=True)
def dofla_console():
    setup_logging()  # idempotent: replaces its own handlers
