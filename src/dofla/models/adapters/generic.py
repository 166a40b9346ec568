"""The generic adapter: any causal LM whose attention modules call transformers' attention interface.

Geometry comes from the config (the same fields transformers itself reads); per-layer sliding
windows follow ``config.layer_types`` when the config has it (Gemma 2/3, Qwen 2/3, ...), else a
model-wide ``sliding_window`` (Mistral, Phi-3). Attention modules are found by their ``layer_idx``.
"""
from __future__ import annotations

import weakref

from torch import nn
from transformers.pytorch_utils import Conv1D

from dofla.models.adapters.base import ADAPTERS, Adapter, AttentionGeometry, UnsupportedModelError

LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
# names of fused or separate q/k/v projections across transformers' model files
_PROJECTION_PARTS = ("qkv", "query", "key_value", "c_attn", "w_pack")
_CROSS_PARTS = ("cross", "encoder_attn")
# model -> its self-attention modules: a converted model asks on every forward, and walking all
# modules costs ~2 ms for 30 layers. Conversion, LoRA wrapping and deepcopy keep this valid.
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_qkv_name(name: str) -> bool:
    name = name.lower()
    return (name in ("q", "k", "v", "key", "value") or name.startswith(("q_", "k_", "v_"))
            or any(part in name for part in _PROJECTION_PARTS))


def _is_attention(module: nn.Module) -> bool:
    """A module with an int ``layer_idx`` and a q/k/v-like projection child (LoRA-wrapped or not)."""
    layer_idx = module.__dict__.get("layer_idx")  # plain attribute; getattr on a Module is slow when absent
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
        return False
    return any(_is_qkv_name(name) for name, _ in module.named_children())


def is_cross_attention(name: str, module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or any(p in name.lower() for p in _CROSS_PARTS)


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention module with a ``layer_idx``, in model order."""
    return [(name, m) for name, m in model.named_modules() if _is_attention(m)]


def self_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules sorted by ``layer_idx``; raises if a layer has none or several."""
    if model in _FOUND:
        return list(_FOUND[model])
    found = [m for name, m in find_attention_modules(model) if not is_cross_attention(name, m)]
    found.sort(key=lambda m: m.layer_idx)
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if [m.layer_idx for m in found] != list(range(len(found))) or not found:
        raise UnsupportedModelError(
            f"model type {model_type!r}: dofla found no self-attention modules numbered 0..L-1 by "
            "`layer_idx`, so its code does not go through transformers' attention interface; "
            "use a model implemented in transformers itself (not remote code)"
        )
    _FOUND[model] = found
    return list(found)


def _required(config, field: str):
    value = getattr(config, field, None)
    if value is None:
        raise UnsupportedModelError(
            f"model type {config.model_type!r}: its config has no {field!r}, which dofla needs to "
            "know the attention geometry; only decoder-only causal LMs with standard configs are supported"
        )
    return value


def config_layer_windows(config) -> tuple[int | None, ...]:
    """Per layer: the sliding window, or None for global attention (how transformers 5 decides)."""
    num_layers = _required(config, "num_hidden_layers")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral, Phi-3: one window for every layer, when set
        use = getattr(config, "use_sliding_window", True)
        return (window if use else None,) * num_layers
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} has attention layer types {unknown}; dofla handles "
            f"only {sorted(LAYER_TYPES)}"
        )
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"model type {config.model_type!r}: config.layer_types has {len(layer_types)} entries "
            f"for {num_layers} layers; fix the config so there is one per layer"
        )
    return tuple(window if LAYER_TYPES[t] else None for t in layer_types)


def config_geometry(config) -> AttentionGeometry:
    """The attention geometry transformers builds from ``config`` (see module doc)."""
    heads = _required(config, "num_attention_heads")
    head_dim = getattr(config, "head_dim", None) or _required(config, "hidden_size") // heads
    return AttentionGeometry(
        num_layers=_required(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_positions=_required(config, "max_position_embeddings"),
        layer_windows=config_layer_windows(config),
        softcap=getattr(config, "attn_logit_softcapping", None),
    )


# Families the tests build (models/tiny.py); any other model type falls back to this adapter too.
@ADAPTERS.register("gemma3_text")
@ADAPTERS.register("gemma2")
@ADAPTERS.register("olmo2")
@ADAPTERS.register("phi3")
@ADAPTERS.register("qwen3")
@ADAPTERS.register("qwen2")
@ADAPTERS.register("mistral")
@ADAPTERS.register("llama")
class GenericAdapter(Adapter):
    """Geometry from the config, attention modules by ``layer_idx``, LoRA on their projections."""

    model_type = "generic"

    def geometry(self, config) -> AttentionGeometry:
        return config_geometry(config)

    def attention_modules(self, model):
        return self_attention_modules(model)

    @property
    def lora_targets(self) -> list[str]:
        """``<attention name>.<projection>`` for every Linear/Conv1D child of the first attention module."""
        if self.model is None:
            raise ValueError("lora_targets needs the model: call get_adapter(model), not get_adapter(config)")
        name, module = next((n, m) for n, m in find_attention_modules(self.model) if not is_cross_attention(n, m))
        prefix = name.rsplit(".", 1)[-1]
        children = [n for n, c in module.named_children()
                    if isinstance(c, (nn.Linear, Conv1D)) or hasattr(c, "base_layer")]
        return [f"{prefix}.{child}" for child in children]
