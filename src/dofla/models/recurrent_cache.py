"""The student's decoding cache: one :class:`RecurrentLayer` per layer, each holding its attention's
fixed-size state (linear, gated delta, hybrid, sliding window) and the number of tokens seen; the
softmax reference layer also keeps every key and value. A Hugging Face ``Cache``, so ``generate()``
passes it through the model unchanged (:class:`~dofla.models.student.StudentMixin` creates it).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dofla.attention import DeltaState, HybridState, LinearState
from dofla.attention.exact import ExactState
from dofla.attention.sliding import SlidingState
from dofla.feature_maps.blocks import BlockState



class MixedState:
    """A mixed layer's decode state (:mod:`dofla.models.mixed_attention`): one state per group of heads."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def length(self) -> int:
        return next(p.length for p in self.parts if p is not None)

    def index_select(self, index: torch.Tensor) -> "MixedState":
        return MixedState([None if p is None else p.index_select(index) for p in self.parts])

    def nbytes(self) -> int:
        return sum(0 if p is None else p.nbytes() for p in self.parts)


State = LinearState | HybridState | BlockState | SlidingState | DeltaState | ExactState | MixedState


class RecurrentLayer(CacheLayerMixin):
    """One layer's decoding state: a fixed-size state (linear / hybrid / sliding) plus the number
    of tokens seen; for the softmax reference (``keep_kv``) also every key/value (B, H_kv, S, d).

    Without ``keep_kv``, ``update`` keeps no keys or values: it returns the new ones unchanged, so
    memory stays flat. Masks are sized (seen + new, offset 0), which is right for the softmax
    reference because it keeps every position; ``is_sliding`` is False for the same reason.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.state: State | None = None
        self.seen = 0
        self.keep_kv = False  # set per call by the student model's forward

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        if not self.keep_kv:
            return key_states, value_states
        if self.keys is not None:
            key_states = torch.cat([self.keys, key_states], dim=-2)
            value_states = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass  # the state is small and stays on its device

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state, self.seen, self.keys, self.values = None, 0, None, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(beam_idx)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def nbytes(self) -> int:
        kept = [t for t in (self.keys, self.values) if t is not None]
        state = 0 if self.state is None else self.state.nbytes()
        return state + sum(t.numel() * t.element_size() for t in kept)


class RecurrentStateCache(Cache):
    """A Hugging Face ``Cache`` holding one :class:`RecurrentLayer` per layer."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[RecurrentLayer() for _ in range(num_layers)])

    def state_bytes(self) -> int:
        """Bytes held by all layers (constant in the tokens seen, except for the softmax reference)."""
        return sum(layer.nbytes() for layer in self.layers)
