"""The ``feature_map`` section of a run: a registered feature map and its options."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dofla.section_keys import Keys


@dataclass
class FeatureMapConfig:
    name: str = "learned_prf"
    options: dict[str, Any] = field(default_factory=dict)

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options"))
