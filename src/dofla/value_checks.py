"""The two value checks every config section's checks use: one clear sentence naming the key, the bad
value and what would be valid (below every package, so each section's checks can sit beside it)."""
from __future__ import annotations

from dofla.errors import require


def positive(key: str, value) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            f"{key}={value!r} must be a positive number")


def one_of(key: str, value, valid) -> None:
    require(value in valid, f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")
