"""What the stages hand each other: one result dataclass per stage whose result a later stage reads
(the data stage's :class:`~dofla.stages.context.RunData` lives with the context), so that no stage
imports another."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DofResult:
    """Algorithm 1's result (``dof.json``): per layer, its heads' DoF (``per_head``) and the layer's
    value (``layer_dof``; None for a layer not estimated), and a warning when the estimate is degenerate.
    ``record`` is the whole stored dict (with the resamples and the spread when asked for)."""

    layer_dof: list
    per_head: list
    warning: str | None
    record: dict

    @classmethod
    def of(cls, record: dict) -> "DofResult":
        return cls(record["layer_dof"], record["per_head"], record.get("warning"), record)


@dataclass(frozen=True)
class Allocation:
    """The allocate stage's result: ``dims`` (one int per layer, or for ``dof_head`` one list of
    per-head ints per layer; 0 for a layer without features) and ``record``, ``allocation.json``."""

    dims: list
    record: dict


@dataclass
class TrainResult:
    """Per-layer training summaries (layerwise), or ``direct``: ``direct_done.json`` (end to end)."""

    summaries: dict[int, dict] = field(default_factory=dict)
    direct: dict | None = None

    def tokens(self) -> int | None:
        """Distillation tokens the features saw when they were counted while training (streamed or
        direct); None when they are the cached tokens."""
        if self.direct is not None:
            return self.direct.get("tokens")
        streamed = [s["tokens"] for s in self.summaries.values() if "tokens" in s]
        return max(streamed) if streamed else None



@dataclass(frozen=True)
class Assembled:
    """The assemble stage's result: the student (eval mode, on the teacher's device, its settings
    attached as ``dofla_settings``) and the layers kept exact softmax (``allocation.softmax_layers``)."""

    student: Any
    softmax_layers: list[int]


@dataclass(frozen=True)
class Finetuned:
    """The finetune stage's result: the LoRA-fine-tuned student (merged weights, settings attached)."""

    student: Any


@dataclass(frozen=True)
class Evaluation:
    """The eval stage's result: every measurement the run asked for, by metric name (``metrics.json``)."""

    metrics: dict
