"""The attention forms a student's layer (or a group of its heads) can take, as registered objects.

A form declares its :class:`Traits` (does it train, does it hold a window of exact recent tokens and
sinks, does it take the scalar decay gate or a learned linear scale, which state it keeps) and
provides what the student needs of it:

- ``check(settings)``: one clear sentence per user error in its settings, before any model loads;
- ``build(settings, features, heads, head_dim)``: its trained part from the layer's feature map
  (None for a form that keeps no linear state) and its gate;
- ``attend(layer, q, k, v, state, key_valid, softcap)``: training and prefill; ``step``: decoding
  one token (the same call unless the form has a faster recurrence);
- ``state_bytes(...)``: the decode state one sequence holds after T tokens.

``settings`` is anything with the fields ``window``, ``sinks``, ``gate``, ``linear_scale``, ``dims``
(a :class:`~dofla.models.spec.ConversionSpec`). ``layer`` is the
:class:`~dofla.models.student_attention.StudentAttention` that holds the form: its feature map, gate,
learned scale, window, sinks and chunk size, and ``for_each_block`` / ``decode_blocks`` for per-head
feature dims. Adding a form is a kernel, a subclass registered with :func:`register`, its config
value and its tests (docs/development.md, "Adding an attention form").

State kinds: ``kv`` every key and value (grows with T), ``none`` only a window (and sinks),
``additive`` the linear state Σ φ(k) vᵀ, ``delta`` the gated delta rule's state.
"""
from __future__ import annotations

from dofla.attention.delta_gates import DeltaFeatureMap, DeltaGates
from dofla.attention.exact import exact_attention
from dofla.attention.hybrid import hybrid_attention_chunked
from dofla.attention.linear import linear_attention_chunked, linear_attention_recurrent
from dofla.attention.naive import softmax_attention
from dofla.attention.sliding import sliding_window_chunked
from dofla.attention.form_registry import (  # noqa: F401 - API: the registry's names, with the forms
    FORMS, NEVER, OPTIONAL, REQUIRED, STATE_BYTES, STATES, AttentionForm, Shape, Traits, form_for, get_form, register,
    selectable,
)


def _expand(layer, k, v):
    """GQA: each query head reads the keys/values of its group, as the teacher does."""
    group = layer.num_heads // layer.num_kv_heads
    return (k, v) if group == 1 else (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def _group(layer, q) -> int:
    """Query heads per KV head in the keys a window keeps once per KV head: the layer's group when ``q`` holds all
    its heads, 1 for one head block of several (per-head feature dims: a block need not hold whole groups)."""
    return layer.num_heads // layer.num_kv_heads if q.shape[1] == layer.num_heads else 1


def _window_bytes(kv_heads: int, head_dim: int, held: int, floats: int = 0, flags: int = 1, heads: int = 0) -> int:
    """``held`` positions: a key and a value of each of ``kv_heads`` (a window keeps each KV head's once), ``floats``
    more numbers for each of ``heads`` query heads (log features, a decay) and ``flags`` bools per position
    (valid, is a sink)."""
    return held * ((kv_heads * 2 * head_dim + heads * floats) * STATE_BYTES + flags)


def _blocks(shape: Shape) -> list[tuple[int, int]]:
    """(heads, features) of each head block: heads of equal feature dim share one state object."""
    return [(shape.features.count(m), m) for m in sorted(set(shape.features))]


@register
class Exact(AttentionForm):
    """The exact softmax reference: every key and value kept (the teacher's cache)."""

    name = "softmax"
    traits = Traits(trains=False, window=NEVER, sinks=False, gate=False, scale=False, state="kv")
    selectable = False  # chosen by feature_map=softmax or softmax_layers, not by attention.name

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        if layer.own_kv:  # beside heads of other forms: it keeps its own keys and values (unexpanded)
            return exact_attention(q, k, v, state, key_valid, softcap)
        if key_valid is None and softcap is None:
            return softmax_attention(q, *_expand(layer, k, v), causal=True), None
        window = max(q.shape[2], 1)  # a window over everything is plain causal softmax
        return sliding_window_chunked(q, k, v, window, 0, window, key_valid=key_valid, softcap=softcap)[0], None

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        return 2 * shape.kv_heads * tokens * shape.head_dim * kv_bytes


@register
class Linear(AttentionForm):
    """The paper's linear attention: a feature map, a fixed-size additive state, optionally gated."""

    name = "linear"
    traits = Traits(trains=True, window=NEVER, sinks=False, gate=True, scale=False, state="additive")

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        k, v = _expand(layer, k, v)
        log_decay = None if layer.gate is None else layer.gate(v)
        if layer.decodes_blocks(state, q):  # one recurrence for all head blocks
            return layer.decode_blocks(q, k, v, state, linear_attention_recurrent, key_valid=key_valid,
                                       log_decay=log_decay)
        return layer.for_each_block(self._blocks, q, k, v, log_decay, state=state, key_valid=key_valid)

    @staticmethod
    def _blocks(layer, feature_map, q, k, v, log_decay=None, state=None, key_valid=None):
        log_q, log_k = layer.log_features(feature_map, q, k)
        if state is not None and q.shape[2] == 1:
            return linear_attention_recurrent(log_q, log_k, v, state=state, key_valid=key_valid, log_decay=log_decay)
        return linear_attention_chunked(log_q, log_k, v, chunk_size=layer.chunk_size, state=state,
                                        key_valid=key_valid, log_decay=log_decay)

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        return sum(shape.features) * (shape.head_dim + 2) * STATE_BYTES


@register
class Hybrid(AttentionForm):
    """Exact softmax over the last ``window`` tokens and ``sinks``, linear attention before."""

    name = "hybrid"
    traits = Traits(trains=True, window=REQUIRED, sinks=True, gate=True, scale=True, state="additive")

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        k, v = _expand(layer, k, v)
        log_decay = None if layer.gate is None else layer.gate(v)
        scale = None if layer.linear_log_scale is None else layer.linear_log_scale.expand(q.shape[0], -1)
        return layer.for_each_block(self._blocks, q, k, v, log_decay, scale, state=state, key_valid=key_valid,
                                    softcap=softcap)

    @staticmethod
    def _blocks(layer, feature_map, q, k, v, log_decay=None, log_scale=None, state=None, key_valid=None,
                softcap=None):
        log_q, log_k = layer.log_features(feature_map, q, k)
        if log_scale is not None:  # e^β on every older key's kernel: log q̂ + β (the exact part reads q, k)
            log_q = log_q + log_scale.to(log_q.dtype)[:, :, None, None]
        return hybrid_attention_chunked(q, k, v, log_q, log_k, layer.window, layer.chunk_size, state,
                                        log_decay=log_decay, sinks=layer.sinks, key_valid=key_valid,
                                        softcap=softcap, group=_group(layer, q))

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        held, left = min(window, tokens), max(0, tokens - window)
        blocks = _blocks(shape)
        kv = (lambda h: shape.kv_heads) if len(blocks) == 1 else (lambda h: h)  # whole groups only in one block
        return sum(h * m * (shape.head_dim + 2) * STATE_BYTES  # each block: its linear state, window and sinks
                   + _window_bytes(kv(h), shape.head_dim, held, m + int(gate), flags=2, heads=h)
                   + _window_bytes(kv(h), shape.head_dim, min(sinks, left)) for h, m in blocks)


@register
class SlidingWindow(AttentionForm):
    """Exact softmax over the first ``sinks`` valid tokens and the last ``window`` positions; training-free."""

    name = "sliding_window"
    traits = Traits(trains=False, window=REQUIRED, sinks=True, gate=False, scale=False, state="none")

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        # each KV head's keys and values once, read by its group of query heads (as the teacher's cache)
        return sliding_window_chunked(q, k, v, layer.window, layer.sinks, layer.chunk_size, state,
                                      key_valid=key_valid, softcap=softcap)

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        held = min(window - 1, tokens)
        return _window_bytes(shape.kv_heads, shape.head_dim, sinks) + _window_bytes(shape.kv_heads, shape.head_dim, held)


@register
class GatedDelta(AttentionForm):
    """The gated delta rule; with a window, the hybrid whose older tokens live in the delta state."""

    name = "gated_delta"
    traits = Traits(trains=True, window=OPTIONAL, sinks=True, gate=False, scale=False, state="delta",
                    shares_layers=False)

    def check(self, settings) -> None:
        if settings.gate != "none" or settings.linear_scale != "fixed":
            raise ValueError("attention='gated_delta' has its own decay and output gates; set gate='none' and "
                             "linear_scale='fixed'")
        if any(isinstance(m, (list, tuple)) for m in settings.dims):
            raise ValueError("attention='gated_delta' takes one feature dimension per layer (its state is M×dv per "
                             "head, with heads batched together); per-head dims (allocation dof_head) do not fit it")
        if settings.sinks and settings.window < 1:
            raise ValueError(f"sinks={settings.sinks} needs window ≥ 1 with attention='gated_delta' (the hybrid with "
                             "a delta state); set sinks=0 or a window")
        super().check(settings)

    def build(self, settings, features, heads, head_dim):
        """The feature map and the gates, trained and saved together."""
        return {**super().build(settings, None, heads, head_dim), "feature_map": self.trained_part(features)}

    def trained_part(self, features):
        return None if features is None else DeltaFeatureMap(features, DeltaGates(features.num_heads,
                                                                                  features.head_dim))

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        k, v = _expand(layer, k, v)  # its gates read v; the hybrid's exact part is the teacher's (capped) softmax
        return layer.feature_map.attend(q, k, v, state, key_valid=key_valid, window=layer.window, sinks=layer.sinks,
                                        softcap=softcap if layer.window > 0 else None, chunk_size=layer.chunk_size,
                                        group=_group(layer, q))

    def state_bytes(self, shape, window, sinks, gate, tokens, kv_bytes=4):
        delta = sum(shape.features) * shape.head_dim * STATE_BYTES
        if window < 1:
            return delta
        held, left = min(window, tokens), max(0, tokens - window)
        (heads, m), = _blocks(shape)  # one dim per layer (check)
        mass = heads * m * 2 * STATE_BYTES  # the older keys' mass: k_sum and its offset
        return delta + mass + _window_bytes(shape.kv_heads, shape.head_dim, held, m + 1, flags=2, heads=heads) \
            + _window_bytes(shape.kv_heads, shape.head_dim, min(sinks, left))

