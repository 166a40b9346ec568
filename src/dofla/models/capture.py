"""Capture each layer's post-RoPE queries, keys and values during a teacher forward pass.

The teacher runs with a capturing attention function registered under ``dofla_capture``: it hands
q (scaled so the kernel is exp(q·k/sqrt(d))), k and v of every layer to a callback, then computes
ordinary SDPA attention so the forward pass is exactly the teacher's.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAPTURE_IMPLEMENTATION = "dofla_capture"

# (layer_idx, q (B, H, T, d), k (B, H_kv, T, d), v (B, H_kv, T, d)) -> None
CaptureCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _capture_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    scale = 1.0 if scaling is None else scaling * math.sqrt(query.shape[-1])
    module.dofla_capture_callback(module.layer_idx, query * scale, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_forward)


@contextmanager
def capturing(model, attention_modules, callback: CaptureCallback):
    """Within the block, every forward of ``model`` reports each layer's q, k, v to ``callback``."""
    previous = model.config._attn_implementation
    for module in attention_modules:
        module.dofla_capture_callback = callback
    model.config._attn_implementation = CAPTURE_IMPLEMENTATION
    try:
        yield
    finally:
        model.config._attn_implementation = previous
        for module in attention_modules:
            del module.dofla_capture_callback


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run the teacher on ``input_ids`` (B, T) and return [(q, k, v)] per layer (see module doc)."""
    from dofla.models.adapters import get_adapter

    captured: dict[int, tuple] = {}
    modules = get_adapter(model).attention_modules(model)
    with capturing(model, modules, lambda i, q, k, v: captured.__setitem__(i, (q, k, v))):
        model(input_ids=input_ids, use_cache=False)
    return [captured[i] for i in range(len(modules))]
