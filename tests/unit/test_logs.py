"""dofla's messages through logging: the bare line on the terminal as print showed it, and the line with
its time, logger and level in the run's log file (Hydra's, or dofla.log where Hydra writes none)."""
from __future__ import annotations

import logging
import logging.config
import re
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from dofla.logs import LOG_FILE, setup_logging

TIME = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]"


def stamped(name: str, level: str, message: str) -> str:
    """The line's pattern in Hydra's job-log format: [time][logger][LEVEL] - message."""
    return rf"{TIME}\[{re.escape(name)}\]\[{level}\] - {re.escape(message)}"


@pytest.fixture
def root_restored():
    """Whatever a test configures on the root logger (Hydra's job logging) is undone after it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:], root.level = handlers, level


def test_without_hydra_the_run_directory_gets_dofla_log_and_the_terminal_the_bare_lines(tmp_path, capsys):
    run_dir = tmp_path / "eval" / "run"
    assert setup_logging(run_dir) == run_dir / LOG_FILE and not run_dir.exists()  # made at the first line
    log = logging.getLogger("dofla.stages.data")
    log.info("dofla: training reads cached teacher activations")
    log.warning("dofla: warning: all layers have nearly the same DoF")
    logging.getLogger("dofla.cli").error("dofla: error: eval.tasks is empty")
    captured = capsys.readouterr()
    assert captured.out == ("dofla: training reads cached teacher activations\n"
                            "dofla: warning: all layers have nearly the same DoF\n")
    assert captured.err == "dofla: error: eval.tasks is empty\n"
    lines = (run_dir / LOG_FILE).read_text().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(stamped("dofla.stages.data", "INFO", "dofla: training reads cached teacher activations"),
                        lines[0])
    assert re.fullmatch(stamped("dofla.stages.data", "WARNING", "dofla: warning: all layers have nearly the same DoF"),
                        lines[1])
    assert re.fullmatch(stamped("dofla.cli", "ERROR", "dofla: error: eval.tasks is empty"), lines[2])


def test_set_up_again_for_the_next_job_each_line_is_shown_once_and_goes_to_that_jobs_log(tmp_path, capsys):
    setup_logging(tmp_path / "0")
    logging.getLogger("dofla.pipeline").info("dofla: job 0")
    setup_logging(tmp_path / "1")
    logging.getLogger("dofla.pipeline").info("dofla: job 1")
    assert capsys.readouterr().out == "dofla: job 0\ndofla: job 1\n"
    assert (tmp_path / "0" / LOG_FILE).read_text().count("dofla: job") == 1
    assert "dofla: job 1" in (tmp_path / "1" / LOG_FILE).read_text()


def test_under_hydras_job_logging_dofla_lines_go_to_its_log_file_and_reach_the_terminal_once_bare(
        tmp_path, capsys, root_restored):
    """Hydra's own job-logging config, as ``@hydra.main`` applies it before dofla runs."""
    conf = OmegaConf.load(Path(hydra.__file__).parent / "conf" / "hydra" / "job_logging" / "default.yaml")
    conf.handlers.file.filename = str(tmp_path / "cli.log")
    logging.config.dictConfig(OmegaConf.to_container(conf))
    assert setup_logging(tmp_path) == tmp_path / "cli.log"
    logging.getLogger("dofla.cache.store").info("dofla: reusing activation cache x")
    logging.getLogger("another.library").warning("a line of another library")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "dofla: reusing activation cache x" and out.count("dofla: reusing activation cache x") == 1
    assert len(out) == 2 and re.fullmatch(stamped("another.library", "WARNING", "a line of another library"), out[1])
    lines = (tmp_path / "cli.log").read_text().splitlines()
    assert re.fullmatch(stamped("dofla.cache.store", "INFO", "dofla: reusing activation cache x"), lines[0])
    assert not (tmp_path / LOG_FILE).exists()  # one log file per run: Hydra's


def test_the_records_still_reach_the_root_logger(caplog):
    setup_logging()
    with caplog.at_level(logging.INFO, logger="dofla"):
        logging.getLogger("dofla.eval.suite").info("dofla: eval reused")
    assert [r.getMessage() for r in caplog.records] == ["dofla: eval reused"]
