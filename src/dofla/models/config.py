"""The ``model`` section of a run: which teacher to load (:func:`dofla.models.load_teacher`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dofla.section_keys import Keys


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    source: str = "embedded:smollm2-135m-instruct"  # hub id, local dir, embedded:..., tiny:<arch>
    revision: Optional[str] = None
    tiny_layers: int = 2  # only for tiny:<arch> sources

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "source", "revision", "tiny_layers"))
