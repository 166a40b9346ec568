"""The attention that replaces softmax inside a converted model, and its decoding cache.

Hugging Face attention modules (GPT-2, GPT-NeoX, Llama, ...) form post-RoPE q, k, v themselves and
then call the function registered under ``config._attn_implementation``. dofla registers
``dofla_linear``: it looks up the :class:`StudentAttention` attached to the calling module as
``module.dofla`` and runs it there. A layer has one of five forms (:mod:`dofla.attention.forms`):

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

from dofla.attention.forms import AttentionForm, Shape, form_for
from dofla.feature_maps import FeatureMap, HeadBlockFeatureMap
from dofla.feature_maps.blocks import BlockState, decode_blocks, feature_dims, for_each_block
from dofla.models.recurrent_cache import RecurrentLayer, State

ATTN_IMPLEMENTATION = "dofla_linear"


class StudentAttention(nn.Module):
    """One layer's student attention, layout (B, H, T, D): it holds what its form needs (feature map, gate,
    learned scale, window, sinks) and delegates to its :mod:`~dofla.attention.forms` form.

    The form follows what the layer holds: ``state`` (the linear state its feature map keeps, "additive" or
    "delta", declared by the form that built it) and ``window``. No feature map and no window is the softmax
    reference, no feature map with a window the sliding window. A caller that sets a part aside for a while
    (the window dropped, the feature map detached, the layer made exact) gets the form that remains.
    A :class:`HeadBlockFeatureMap` gives heads their own feature dims. ``softcap`` (Gemma 2) caps the
    exact softmax scores.
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
        state: str = "additive",
        form: AttentionForm | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.feature_map = feature_map
        self.chunk_size = chunk_size
        self.window = window  # > 0: exact softmax over the last `window` tokens (hybrid or sliding)
        self.sinks = sinks  # exact softmax over the first `sinks` valid tokens too
        self.softcap = softcap
        self.state_kind = state  # the linear state the feature map keeps (forms.STATES)
        self.built_form = form  # the form that built it (None: the one its state and window pick)
        self.own_kv = False  # exact heads beside heads of other forms keep their own keys and values
        form = self.form
        if gate is not None and not form.traits.gate:
            raise ValueError("a scalar decay gate decays an additive linear state: it needs a linear or hybrid layer "
                             "(a feature map, not a gated-delta layer, which has its own gates); drop the gate")
        self.gate = gate  # linear and hybrid: a per-head decay of the linear state (dofla.attention.gate), or None
        if learned_scale and not form.traits.scale:
            raise ValueError("a learned linear scale weighs a hybrid's linear part against its exact window; this "
                             "layer has none (in pure linear attention a per-head scale cancels): drop it")
        # hybrid: per-head log scale β_h of the linear kernel (e^β K̂ against the window's e^{q·k/√d}), from 0
        self.linear_log_scale = nn.Parameter(torch.zeros(num_heads)) if learned_scale else None
        # Set by the student model's forward for the duration of a call.
        self.cache_layer: RecurrentLayer | None = None
        self.key_valid: torch.Tensor | None = None

    @property
    def form(self) -> AttentionForm:
        """The form that built the layer while the layer still holds what it needs, else the form of what it
        holds now (its state, or none without a feature map, and its window)."""
        state = self.state_kind if self.feature_map is not None else "none" if self.window > 0 else "kv"
        built = self.built_form
        if built is not None and built.traits.state == state and built.accepts(self.window):
            return built
        return form_for(state, self.window)

    @property
    def mode(self) -> str:
        """The layer's kind as the reports name it: its form's, except that a window with a linear state
        of either kind is "hybrid" (what the window dropout and the linear-part ablation act on)."""
        form = self.form
        return "hybrid" if self.window > 0 and form.traits.state in ("additive", "delta") else form.name

    @property
    def keeps_kv_cache(self) -> bool:
        """Exact in every head: its keys and values live in the teacher's cache layer, its mask is the teacher's."""
        return self.form.traits.state == "kv" and not self.own_kv

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
        if state is not None and q.shape[2] == 1:
            return self.form.step(self, q, k, v, state, key_valid, softcap)
        return self.form.attend(self, q, k, v, state, key_valid, softcap)

    def for_each_block(self, fn, *per_head, state: State | None = None, **options):
        """``fn(self, block_map, *its heads' tensors, state=..., **options)`` per head block of the feature map."""
        call = functools.partial(fn, self, **options)
        return for_each_block(self.feature_map, lambda fm, *t, state=None: call(fm, *t, state=state), *per_head,
                              state=state)

    def decodes_blocks(self, state: State | None, q: torch.Tensor) -> bool:
        """A decoding step of a layer with head blocks: one recurrence over every head (:func:`decode_blocks`)."""
        return isinstance(state, BlockState) and q.shape[2] == 1

    def decode_blocks(self, q, k, v, state: BlockState, step, **options):
        return decode_blocks(self.feature_map, q, k, v, state, step, **options)

    def state_bytes(self, tokens: int, kv_bytes: int = 4) -> int:
        """Bytes of one sequence's decode state after ``tokens`` tokens, as the form predicts it."""
        dims = () if self.feature_map is None else feature_dims(self.feature_map)
        features = tuple(dims) if isinstance(dims, (list, tuple)) else (int(dims),) * self.num_heads
        shape = Shape(self.num_heads, self.num_kv_heads, self.head_dim, features)
        return self.form.state_bytes(shape, self.window, self.sinks, self.gate is not None, tokens, kv_bytes)

    @staticmethod
    def log_features(feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor):
        """(log φ(q), log φ(k)); a decoding step's two tokens in one call."""
        if q.shape[2] == 1 and k.shape[2] == 1:
            return feature_map.log_features(torch.cat([q, k], dim=2)).split(1, dim=2)
        return feature_map.log_features(q), feature_map.log_features(k)


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
    if student.keeps_kv_cache:  # exact: the teacher's own mask and cache
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
