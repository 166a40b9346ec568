"""The attention that replaces softmax inside a converted model, and its decoding cache.

Hugging Face attention modules (GPT-2, GPT-NeoX, Llama) form post-RoPE q, k, v themselves and
then call the function registered under ``config._attn_implementation``. dofla registers
``dofla_linear``: it looks up the :class:`StudentAttention` attached to the calling module as
``module.dofla`` and runs linear attention there. During decoding the per-layer recurrent state
lives in a :class:`RecurrentStateCache`, whose size does not depend on the number of tokens seen.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from dofla.attention import (
    HybridState,
    LinearState,
    hybrid_attention_chunked,
    linear_attention_chunked,
    linear_attention_recurrent,
    softmax_attention,
)
from dofla.feature_maps import FeatureMap, HeadBlockFeatureMap
from dofla.feature_maps.blocks import BlockState, for_each_block

ATTN_IMPLEMENTATION = "dofla_linear"
State = LinearState | HybridState | BlockState


class StudentAttention(nn.Module):
    """Linear attention (or the softmax reference) for one layer, layout (B, H, T, D).

    ``feature_map`` is None for ``mode="softmax"``, the exact reference used to check that a
    conversion reproduces the teacher; a :class:`HeadBlockFeatureMap` gives heads their own dims.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        feature_map: FeatureMap | HeadBlockFeatureMap | None,
        chunk_size: int = 128,
        window: int = 0,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.feature_map = feature_map
        self.chunk_size = chunk_size
        self.window = window  # > 0: exact softmax over the last `window` tokens (hybrid attention)
        # Set by the student model's forward for the duration of a cached call.
        self.cache_layer: RecurrentLayer | None = None

    @property
    def num_features(self) -> float:
        return 0 if self.feature_map is None else self.feature_map.num_features

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State | None = None
    ) -> tuple[torch.Tensor, State | None]:
        """q (B, H, T, d) scaled so the teacher kernel is exp(q·k/sqrt(d)); k, v (B, H_kv, T, d)."""
        if self.feature_map is None:
            return softmax_attention(q, k, v, causal=True), None
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # GQA: each query head reads the keys/values of its group, as the teacher does
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        return for_each_block(self.feature_map, self._attend, q, k, v, state=state)

    def _attend(self, feature_map: FeatureMap, q, k, v, state: State | None = None):
        """Linear (or hybrid) attention of heads sharing one feature map."""
        log_q = feature_map.log_features(q)
        log_k = feature_map.log_features(k)
        if self.window > 0:
            return hybrid_attention_chunked(q, k, v, log_q, log_k, self.window, self.chunk_size, state)
        if state is not None and q.shape[2] == 1:
            return linear_attention_recurrent(log_q, log_k, v, state=state)
        return linear_attention_chunked(log_q, log_k, v, chunk_size=self.chunk_size, state=state)


def dofla_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface entry point; returns (B, T, H, D) like the built-ins."""
    student: StudentAttention = module.dofla
    if scaling is not None:  # fold the module's own scale into q so the kernel is exp(q·k/sqrt(d))
        query = query * (scaling * math.sqrt(query.shape[-1]))
    layer = student.cache_layer
    out, state = student(query, key, value, state=None if layer is None else layer.state)
    if layer is not None:
        layer.state = state
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, dofla_attention_forward)


class RecurrentLayer(CacheLayerMixin):
    """One layer's decoding state: a :class:`LinearState` plus the number of tokens seen.

    ``update`` keeps no keys or values: it returns the new ones unchanged, so memory stays flat.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.state: State | None = None
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(beam_idx)


class RecurrentStateCache(Cache):
    """A Hugging Face ``Cache`` holding fixed-size linear-attention states, one per layer."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[RecurrentLayer() for _ in range(num_layers)])

    def state_bytes(self) -> int:
        """Bytes held by all layers' states (constant in the number of tokens seen)."""
        return sum(layer.state.nbytes() for layer in self.layers if layer.state is not None)
