"""Architecture adapters: everything model-specific about a causal LM's attention.

One adapter per Hugging Face ``config.model_type``. An adapter knows where the attention modules
are and the attention geometry (heads, KV heads, head size). How q/k/v are formed (GPT-2's fused
``c_attn``, GPT-NeoX's partial rotary, Llama's GQA + RoPE) stays in the Hugging Face module
itself: all three call the registered attention function with post-RoPE (B, H, T, d) tensors,
which is where dofla captures activations and swaps in linear attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from dofla.registry import Registry

ADAPTERS: Registry[type["Adapter"]] = Registry("model architecture")


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of a model's attention that the rest of the pipeline needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads


class Adapter:
    model_type: ClassVar[str]
    lora_targets: ClassVar[list[str]]

    def geometry(self, config) -> AttentionGeometry:
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The self-attention modules in layer order; each has a ``layer_idx``."""
        raise NotImplementedError


def get_adapter(model_or_config) -> Adapter:
    """The adapter for a model (or its config), keyed by ``config.model_type``."""
    config = getattr(model_or_config, "config", model_or_config)
    return ADAPTERS.get(config.model_type)()
