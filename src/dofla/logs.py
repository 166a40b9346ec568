"""Where dofla's messages go when a command runs: each ``dofla:`` line on the terminal as a person reads
it (the message alone: stdout, errors on stderr), and with its time, logger and level in the run's log file.

Library modules only log (``logger = logging.getLogger(__name__)``); the commands call
:func:`setup_logging`. Under ``@hydra.main`` Hydra's job logging already writes the run's log file
(``<run dir>/<job name>.log``): dofla's records reach it through the root logger, and Hydra's console
handler leaves them to dofla's own, so the terminal shows no timestamps. Where no such file is written
(the compose API of ``dofla-eval``, or ``hydra/job_logging=disabled``) the run directory gets ``dofla.log``.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's own job-log format
LOG_FILE = "dofla.log"  # when Hydra writes no log file into the run directory


class Console(logging.StreamHandler):
    """The message alone, as print wrote it: errors to stderr, the rest to stdout. The stream is looked up
    at each record, so a redirected or captured sys.stdout receives the lines."""

    _error = False  # the record being written is an error (set under the handler's lock, in emit)

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr if self._error else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; the property decides per record
        pass

    def emit(self, record: logging.LogRecord) -> None:
        self._error = record.levelno >= logging.ERROR
        super().emit(record)


class RunLog(logging.FileHandler):
    """The run's log file, opened (and its directory made) at the first record: a command that fails
    before saying anything leaves no directory behind."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8", delay=True)
        self.setFormatter(logging.Formatter(FILE_FORMAT))

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def not_dofla(record: logging.LogRecord) -> bool:
    """Filter for a console handler above dofla's: dofla's records are on the terminal already."""
    return not (record.name == "dofla" or record.name.startswith("dofla."))


def _writes_into(handler: logging.Handler, directory: Path) -> bool:
    return isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent.resolve() == directory.resolve()


def setup_logging(run_dir: Path | None = None) -> Path | None:
    """dofla's INFO and above on the terminal and, with ``run_dir``, in the run's log file (which is
    returned). Called again (the next job of a multirun in the same process), it replaces its handlers."""
    package = logging.getLogger("dofla")
    package.setLevel(logging.INFO)
    for handler in [h for h in package.handlers if getattr(h, "dofla", False)]:
        package.removeHandler(handler)
        handler.close()
    console = Console()
    console.dofla = True
    package.addHandler(console)
    root = logging.getLogger()
    for handler in root.handlers:  # Hydra's console (exactly a StreamHandler; pytest's capture is a subclass)
        if type(handler) is logging.StreamHandler and not_dofla not in handler.filters:
            handler.addFilter(not_dofla)
    if run_dir is None:
        return None
    run_dir = Path(run_dir)
    hydra_file = next((h for h in root.handlers if _writes_into(h, run_dir)), None)
    if hydra_file is not None:
        return Path(hydra_file.baseFilename)
    file = RunLog(run_dir / LOG_FILE)
    file.dofla = True
    package.addHandler(file)
    return run_dir / LOG_FILE
