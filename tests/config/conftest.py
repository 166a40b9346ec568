from tests.console_logging import dofla_console  # noqa: F401 - autouse: dofla's lines on stdout, as the commands print them
