"""Which models dofla can convert: one clear sentence for each that it cannot, before any work.

Handled: GQA, sliding-window layers (``geometry.layer_windows``), any logit scaling and q/k norms
(applied by the Hugging Face module before the attention function), logit soft-capping
(``geometry.softcap``). Refused: encoder-decoders, cross-attention, multimodal wrappers,
bidirectional attention, learned attention sinks, position biases passed to the attention
function (ALiBi-style), and code that does not call transformers' attention interface.
"""
from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface

from dofla.models.adapters.base import ADAPTERS, Adapter, UnsupportedModelError
from dofla.models.adapters.generic import GenericAdapter, config_geometry, find_attention_modules, is_cross_attention

PROBE_IMPLEMENTATION = "dofla_probe"
SINK_MODEL_TYPES = ("gpt_oss",)  # known before loading any weight: learned per-head sink logits
_BIAS_KWARGS = ("s_aux", "sinks", "position_bias", "alibi")
# models whose modules passed check_modules: get_adapter runs on every student forward, so once is enough
_CHECKED_MODELS: weakref.WeakSet = weakref.WeakSet()


def _refuse(config, what: str, fix: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"model type {config.model_type!r} {what}, which dofla cannot convert; {fix}")


def check_config(config) -> None:
    """Refusals that the config alone decides (run before any weight is loaded)."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(config, "is an encoder-decoder", "use a decoder-only causal LM")
    if getattr(config, "add_cross_attention", False):
        raise _refuse(config, "has cross-attention", "use a decoder-only causal LM without add_cross_attention")
    if any(hasattr(config, k) for k in ("text_config", "vision_config", "audio_config")):
        raise _refuse(config, "is a multimodal model", "load its text-only causal LM checkpoint instead")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(config, "has bidirectional attention", "use a causal (decoder-only) LM")
    if config.model_type in SINK_MODEL_TYPES:
        raise _refuse(config, "has learned attention sinks", "use a model without sink logits")
    config_geometry(config)  # missing fields and unknown layer types raise here


def check_modules(model) -> None:
    """Refusals that need the model's modules (no forward pass; done once per model)."""
    if model in _CHECKED_MODELS:
        return
    config = model.config
    found = find_attention_modules(model)
    if any(is_cross_attention(name, m) for name, m in found):
        raise _refuse(config, "has cross-attention modules", "use a decoder-only causal LM")
    for _, module in found:
        if any("sink" in name.lower() for name, _ in module.named_parameters()):
            raise _refuse(config, "has learned attention sinks", "use a model without sink logits")
    modules = get_adapter_class(config)(model).attention_modules(model)
    num_layers = config_geometry(config).num_layers
    if len(modules) != num_layers:
        raise _refuse(config, f"has {len(modules)} self-attention modules for {num_layers} layers",
                      "use a model whose every layer has one self-attention module")
    _CHECKED_MODELS.add(model)


def check_supported(model_or_config, probe: bool = False) -> None:
    """Raise :class:`UnsupportedModelError` (one sentence) if dofla cannot convert this model.

    With a config, only the config is checked; with a model, its modules too; with ``probe=True``
    also a dry 4-token forward (:func:`probe_attention_calls`).
    """
    config = getattr(model_or_config, "config", model_or_config)
    check_config(config)
    if config is not model_or_config:
        check_modules(model_or_config)
        if probe:
            probe_attention_calls(model_or_config)


def get_adapter_class(config) -> type[Adapter]:
    model_type = config.model_type
    return ADAPTERS.get(model_type) if model_type in ADAPTERS else GenericAdapter


def get_adapter(model_or_config) -> Adapter:
    """The adapter for a model (or its config): the registered one for ``config.model_type``,
    else the generic adapter; refuses models dofla cannot convert (:func:`check_supported`)."""
    check_supported(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    model = None if config is model_or_config else model_or_config
    return get_adapter_class(config)(model)


def _probe_forward(module, query, key, value, attention_mask, **kwargs):
    module.dofla_probe.append((module, query.shape, key.shape, value.shape, kwargs))
    batch, _, length, _ = query.shape
    return query.new_zeros(batch, length, query.shape[1], value.shape[-1]), None


AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_forward)


@torch.no_grad()
def probe_attention_calls(model) -> None:
    """Dry forward on 4 tokens through a recording attention function: every layer must call it
    once with the geometry's shapes, windows and soft-cap, and with no sinks or position biases."""
    config = model.config
    modules = get_adapter_class(config)(model).attention_modules(model)
    calls: list = []
    previous = config._attn_implementation
    for module in modules:
        module.dofla_probe = calls
    config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.arange(4, device=device)[None] % config.vocab_size, use_cache=False)
    finally:
        config._attn_implementation = previous
        for module in modules:
            del module.dofla_probe
    _check_calls(config, modules, calls)


def _check_calls(config, modules, calls) -> None:
    if [id(c[0]) for c in calls] != [id(m) for m in modules]:
        raise _refuse(config, "does not call transformers' attention interface once per layer",
                      "use a model implemented in transformers itself (not remote code)")
    g = config_geometry(config)
    for i, (module, q, k, v, kwargs) in enumerate(calls):
        if (q[1], q[3], k[1], k[3], v[1], v[3]) != (g.num_heads, g.head_dim, g.num_kv_heads, g.head_dim,
                                                    g.num_kv_heads, g.head_dim):
            raise _refuse(config, f"has layer {i} q/k/v shapes {tuple(q)}, {tuple(k)}, {tuple(v)} that differ "
                          "from the config's heads and head size", "use a model with uniform attention heads")
        if any(kwargs.get(name) is not None for name in _BIAS_KWARGS):
            raise _refuse(config, "passes attention sinks or position biases to the attention function",
                          "use a model without them")
        if getattr(module, "is_causal", True) is False:
            raise _refuse(config, "has bidirectional attention", "use a causal (decoder-only) LM")
        if kwargs.get("sliding_window", g.layer_windows[i]) != g.layer_windows[i]:
            raise _refuse(config, f"slides layer {i} over {kwargs['sliding_window']} tokens but its config "
                          f"says {g.layer_windows[i]}", "report this model type to the dofla maintainers")
        if kwargs.get("softcap", g.softcap) != g.softcap:
            raise _refuse(config, f"soft-caps layer {i} at {kwargs['softcap']} but its config says {g.softcap}",
                          "report this model type to the dofla maintainers")
