"""One base class for every error a user can cause (a bad config value, a missing dataset or model,
a corrupt cache, an artifact that cannot be resumed): the CLI prints its one-sentence message and
exits with status 2, no traceback. Each module raises its own subclass."""
from __future__ import annotations


class DoflaError(Exception):
    """A user-fixable problem; the message names the cause and the fix."""


class ConfigError(DoflaError, ValueError):
    """A config value that cannot work; the message names the key and the valid values."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)
