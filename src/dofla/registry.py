"""A small name -> object registry shared by feature maps, adapters, policies, losses and measurements.

YAML option file name = registry key = the object's ``name``; an unknown name fails with the
list of valid names and the closest match.
"""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

from dofla.errors import DoflaError

T = TypeVar("T")


def did_you_mean(name: object, valid) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or "" when none is close."""
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownNameError(DoflaError, KeyError, ValueError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to objects (usually classes or functions) registered with ``@registry.register``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UnknownNameError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: str) -> str:
        return f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; valid: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return sorted(self._items)

    def in_order(self) -> list[T]:
        """The registered objects in the order they were registered (for registries whose order is
        part of their meaning, e.g. the eval stage's measurements)."""
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items
