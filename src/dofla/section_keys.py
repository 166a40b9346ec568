"""How a config section's fields enter the artifact keys: :class:`Keys`, declared beside each section's
fields (each section's dataclass lives beside its consumer; :mod:`dofla.config` composes them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Keys:
    """How a section's fields enter the artifact keys (:mod:`dofla.stages.keys`): ``in_key`` change what
    an artifact holds, ``out`` do not (how or where a job runs); a field in neither fails loudly once a
    key reads the section. ``legacy``: fields added after artifacts were written, at the value that
    reproduces those; a field at it is left out of its key, so older artifacts stay valid."""

    in_key: tuple[str, ...] = ()
    out: tuple[str, ...] = ()
    legacy: dict[str, Any] = field(default_factory=dict)
