"""The ``attention`` section of a run: the student's attention form (:mod:`dofla.attention`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from dofla.section_keys import Keys


@dataclass
class AttentionConfig:
    name: str = "linear"
    window: int = 0  # > 0: exact softmax over the last `window` tokens, linear attention before
    sinks: int = 0  # exact softmax also over the first `sinks` tokens (hybrid, sliding_window)
    chunk_size: Any = 128  # linear kernel's chunk (128: fastest here); auto: timed once per machine
    gate: str = "none"  # none | scalar (linear, hybrid: a per-head decay of the linear state, trained by distill=kl)
    linear_scale: str = "fixed"  # fixed | learned (hybrid: a per-head weight of the linear part, trained by distill=kl)
    # a JSON or YAML file giving every KV head of every layer its own attention (dofla.models.plan), in place of
    # the settings above but chunk_size; keys hold a hash of its plan, not its path
    plan: Optional[str] = None

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "window", "sinks", "chunk_size", "gate", "linear_scale", "plan"),
                                legacy={"sinks": 0, "gate": "none", "linear_scale": "fixed", "plan": None})
