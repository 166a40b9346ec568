"""Architecture adapters: everything model-specific about a causal LM's attention.

Every transformers 5.x causal LM forms post-RoPE (B, H, T, d) queries, keys and values itself
(fused or separate projections, q/k norms, partial rotary, GQA) and then calls the function
registered under ``config._attn_implementation``. That call is where dofla captures activations
and swaps in linear attention, so an adapter only needs to know where the attention modules are,
the attention geometry, and which projections a LoRA fine-tune adapts. :mod:`.generic` handles
any model that goes through the interface; :mod:`.support` refuses the ones dofla cannot convert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from dofla.errors import DoflaError
from dofla.registry import Registry

ADAPTERS: Registry[type["Adapter"]] = Registry("model architecture")


class ModelLoadError(DoflaError, RuntimeError):
    """A model could not be loaded; the message says why and how to get it."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """A model dofla cannot convert; the message names the model type and what is missing."""


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of a model's attention that the rest of the pipeline needs.

    ``layer_windows[i]`` is layer i's sliding window W (the query at t attends to keys
    t-W+1..t, itself included, as in transformers' sliding-window masks) or None for global causal
    attention; empty means every layer is global. ``softcap`` c caps the attention logits as
    c·tanh(s/c) before the softmax (Gemma 2), None when the model does not.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    layer_windows: tuple[int | None, ...] = ()
    softcap: float | None = None

    def __post_init__(self):
        windows = tuple(self.layer_windows) or (None,) * self.num_layers
        if len(windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries for {self.num_layers} layers")
        object.__setattr__(self, "layer_windows", windows)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def sliding_layers(self) -> list[int]:
        """Indices of the layers that attend within a sliding window."""
        return [i for i, w in enumerate(self.layer_windows) if w is not None]


class Adapter:
    """Where a model's attention lives. Built by :func:`get_adapter` for one model (or config)."""

    model_type: ClassVar[str] = ""

    def __init__(self, model: nn.Module | None = None):
        self.model = model

    def geometry(self, config) -> AttentionGeometry:
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The self-attention modules in layer order; each has a ``layer_idx``."""
        raise NotImplementedError

    @property
    def lora_targets(self) -> list[str]:
        """Attention projections a LoRA fine-tune adapts (module-name suffixes, as peft matches them)."""
        raise NotImplementedError
