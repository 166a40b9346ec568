"""The attention that replaces softmax inside a converted model, and its decoding cache.

Hugging Face attention modules (GPT-2, GPT-NeoX, Llama, ...) form post-RoPE q, k, v themselves and
then call the function registered under ``config._attn_implementation``. dofla registers
``dofla_linear``: it looks up the :class:`StudentAttention` attached to the calling module as
``module.dofla`` and runs it there. A layer has one of five modes:

- ``linear``: the paper's linear attention (a feature map, fixed-size state);
- ``gated_delta``: the gated delta rule (:mod:`dofla.attention.delta`; a feature map and gates,
  :class:`~dofla.attention.delta_gates.DeltaFeatureMap`, state M×dv per head);
- ``hybrid``: exact softmax over the last ``window`` tokens (+ ``sinks``), linear attention (or,
  with a delta feature map, a delta state, :mod:`dofla.attention.delta_hybrid`) before;
- ``sliding_window``: exact softmax over the first ``sinks`` valid tokens and the last ``window``
  positions, nothing else (training-free; state O(sinks + window));
- ``softmax``: the exact reference. Its cache layer keeps every key/value (memory grows, it is
  the reference) and it attends with the teacher's own 4D mask, so causal + padding + the
  layer's sliding window apply exactly.

Padding: the student reads the 2D (B, T) ``attention_mask`` given to the model's forward (what
``generate()`` and lm-eval pass), not the 4D mask: building a (B, 1, T, T) mask would cost the
T² memory linear attention avoids, and Hugging Face builds no 4D mask at all for an
implementation it does not know. :class:`~dofla.models.student.StudentMixin` slices the new
tokens' columns into ``StudentAttention.key_valid`` (None when nothing is padded, so unpadded
decoding does no extra work). Padded keys contribute nothing: linear layers set their log
features to −inf and values to 0, hybrid layers pass ``key_valid`` on, sliding-window layers skip
them. Only the softmax reference asks Hugging Face for the 4D mask (see :func:`dofla_mask`).

During decoding the per-layer state lives in a
:class:`~dofla.models.recurrent_cache.RecurrentStateCache`; except for the softmax reference its size
does not depend on the number of tokens seen.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dofla.attention import (
    hybrid_attention_chunked,
    linear_attention_chunked,
    linear_attention_recurrent,
    softmax_attention,
)
from dofla.attention.delta_gates import is_delta
from dofla.attention.sliding import sliding_window_chunked
from dofla.feature_maps import FeatureMap, HeadBlockFeatureMap
from dofla.feature_maps.blocks import BlockState, decode_blocks, for_each_block
from dofla.models.recurrent_cache import RecurrentLayer, State

ATTN_IMPLEMENTATION = "dofla_linear"


class StudentAttention(nn.Module):
    """One layer's student attention, layout (B, H, T, D); see the module docstring for the modes.

    ``feature_map`` None and ``window`` 0 is the softmax reference; None and ``window`` > 0 the
    sliding-window + ``sinks`` attention; a feature map with ``window`` > 0 is hybrid, without it
    linear (gated delta for a :class:`~dofla.attention.delta_gates.DeltaFeatureMap`, which holds its gates).
    A :class:`HeadBlockFeatureMap` gives heads their own feature dims. ``softcap`` (Gemma 2)
    caps the exact softmax scores of the softmax and sliding modes.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        feature_map: FeatureMap | HeadBlockFeatureMap | None,
        chunk_size: int = 128,
        window: int = 0,
        sinks: int = 0,
        softcap: float | None = None,
        gate: nn.Module | None = None,
        learned_scale: bool = False,
    ):
        super().__init__()
        if gate is not None and (feature_map is None or is_delta(feature_map)):
            raise ValueError("a scalar decay gate decays an additive linear state: it needs a linear or hybrid layer "
                             "(a feature map, not a gated-delta layer, which has its own gates); drop the gate")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.feature_map = feature_map
        self.chunk_size = chunk_size
        self.window = window  # > 0: exact softmax over the last `window` tokens (hybrid or sliding)
        self.sinks = sinks  # exact softmax over the first `sinks` valid tokens too
        self.softcap = softcap
        self.gate = gate  # linear and hybrid: a per-head decay of the linear state (dofla.attention.gate), or None
        if learned_scale and (feature_map is None or window < 1 or is_delta(feature_map)):
            raise ValueError("a learned linear scale weighs a hybrid's linear part against its exact window; this "
                             "layer has none (in pure linear attention a per-head scale cancels): drop it")
        # hybrid: per-head log scale β_h of the linear kernel (e^β K̂ against the window's e^{q·k/√d}), from 0
        self.linear_log_scale = nn.Parameter(torch.zeros(num_heads)) if learned_scale else None
        # Set by the student model's forward for the duration of a call.
        self.cache_layer: RecurrentLayer | None = None
        self.key_valid: torch.Tensor | None = None

    @property
    def mode(self) -> str:
        if self.feature_map is None:
            return "softmax" if self.window == 0 else "sliding_window"
        if self.window > 0:
            return "hybrid"
        return "gated_delta" if is_delta(self.feature_map) else "linear"

    @property
    def num_features(self) -> float:
        return 0 if self.feature_map is None else self.feature_map.num_features

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State | None = None,
        key_valid: torch.Tensor | None = None, softcap: float | None = None,
    ) -> tuple[torch.Tensor, State | None]:
        """q (B, H, T, d) scaled so the teacher kernel is exp(q·k/sqrt(d)); k, v (B, H_kv, T, d);
        key_valid (B, T) bool, False at padded tokens (None: all valid); softcap overrides
        ``self.softcap``. Returns (B, H, T, d) and the new decode state."""
        softcap = self.softcap if softcap is None else softcap
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # GQA: each query head reads the keys/values of its group, as the teacher does
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if self.mode == "softmax":
            if key_valid is None and softcap is None:
                return softmax_attention(q, k, v, causal=True), None
            window = max(q.shape[2], 1)  # a window over everything is plain causal softmax
            return sliding_window_chunked(q, k, v, window, 0, window, key_valid=key_valid, softcap=softcap)[0], None
        if self.mode == "sliding_window":
            return sliding_window_chunked(q, k, v, self.window, self.sinks, self.chunk_size, state,
                                          key_valid=key_valid, softcap=softcap)
        if is_delta(self.feature_map):  # its gates read v; the hybrid's exact part is the teacher's (capped) softmax
            return self.feature_map.attend(q, k, v, state, key_valid=key_valid, window=self.window, sinks=self.sinks,
                                           softcap=softcap if self.window > 0 else None, chunk_size=self.chunk_size)
        attend = functools.partial(self._attend, key_valid=key_valid)
        log_decay = None if self.gate is None else self.gate(v)
        scale = None if self.linear_log_scale is None else self.linear_log_scale.expand(q.shape[0], -1)
        if isinstance(state, BlockState) and self.window == 0 and q.shape[2] == 1:  # one recurrence for all blocks
            return decode_blocks(self.feature_map, q, k, v, state, linear_attention_recurrent, key_valid=key_valid,
                                 log_decay=log_decay)
        return for_each_block(self.feature_map, attend, q, k, v, log_decay, scale, state=state)

    def _attend(self, feature_map: FeatureMap, q, k, v, log_decay=None, log_scale=None, state: State | None = None,
                key_valid=None):
        """Linear (or hybrid) attention of heads sharing one feature map; log_decay (B, H, T) the gate's,
        log_scale (B, H) the hybrid's learned linear scale (None: 0)."""
        if q.shape[2] == 1 and k.shape[2] == 1:  # a decoding step: both tokens' features in one call
            log_q, log_k = feature_map.log_features(torch.cat([q, k], dim=2)).split(1, dim=2)
        else:
            log_q, log_k = feature_map.log_features(q), feature_map.log_features(k)
        if log_scale is not None:  # e^β on every older key's kernel: log q̂ + β (the exact part reads q, k)
            log_q = log_q + log_scale.to(log_q.dtype)[:, :, None, None]
        if self.window > 0:
            extra = {} if key_valid is None else {"key_valid": key_valid}
            if self.sinks:
                extra["sinks"] = self.sinks
            if self.softcap is not None:  # the exact part is the teacher's capped softmax
                extra["softcap"] = self.softcap
            return hybrid_attention_chunked(q, k, v, log_q, log_k, self.window, self.chunk_size, state,
                                            log_decay=log_decay, **extra)
        # the kernels mask padded keys (no contribution) and their decay (none) from key_valid
        if state is not None and q.shape[2] == 1:
            return linear_attention_recurrent(log_q, log_k, v, state=state, key_valid=key_valid, log_decay=log_decay)
        return linear_attention_chunked(log_q, log_k, v, chunk_size=self.chunk_size, state=state, key_valid=key_valid,
                                        log_decay=log_decay)


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
    """Hugging Face attention-interface entry point; returns (B, T, H, D) like the built-ins.

    ``scaling`` (the module's own score scale, e.g. Gemma's query_pre_attn_scalar) is honoured:
    the softmax reference passes it on, the other modes fold it into q.
    """
    student: StudentAttention = module.dofla
    softcap = kwargs.pop("softcap", None)
    softcap = student.softcap if softcap is None else softcap
    if student.mode == "softmax":
        return softmax_reference_forward(module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs)
    factor = 1.0 if scaling is None else scaling * math.sqrt(query.shape[-1])
    if factor != 1.0:  # fold the module's own scale into q so the kernel is exp(q·k/sqrt(d)); 1/sqrt(d) needs no pass
        query = query * factor
    layer = student.cache_layer
    out, state = student(query, key, value, state=None if layer is None else layer.state,
                         key_valid=student.key_valid, softcap=softcap)
    if layer is not None:
        layer.state = state
    return out.transpose(1, 2).contiguous(), None


def softmax_reference_forward(
    module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs
) -> tuple[torch.Tensor, None]:
    """Exact attention with the teacher's 4D mask; key/value (B, H_kv, S, d) hold every cached
    position. SDPA cannot cap scores, so with ``softcap`` it is eager: cap·tanh(s/cap), then mask."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    group = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, group), repeat_kv(value, group)
    scores = (query @ key.transpose(-1, -2)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    mask = attention_mask
    if mask is None:  # Hugging Face skipped the mask: plain causal, queries are the last T positions
        t, s = query.shape[2], key.shape[2]
        mask = torch.arange(s, device=query.device)[None, :] <= torch.arange(t, device=query.device)[:, None] + s - t
    if mask.dtype == torch.bool:  # finfo.min, not −inf: a fully masked (pad) row stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask[..., : key.shape[2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return (probs @ value).transpose(1, 2).contiguous(), None


def dofla_mask(*args, config=None, **kwargs) -> torch.Tensor | None:
    """Mask-interface entry for ``dofla_linear``: the softmax reference, and a student with layers
    restored to softmax (``softmax_layers``), get Hugging Face's own sdpa mask (causal, padding,
    sliding window) for those layers; a student without exact layers gets None (no T×T mask) and
    reads padding from the 2D mask instead."""
    spec = getattr(config, "dofla", None) or {}
    if spec.get("feature_map") != "softmax" and not spec.get("softmax_layers"):
        return None
    return sdpa_mask(*args, config=config, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, dofla_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dofla_mask)
