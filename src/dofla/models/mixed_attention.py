"""A layer whose KV heads take different forms (:mod:`dofla.models.plan`): say head 0 exact, head 1 a window
of 256 with sinks, head 2 a window of 64 with a delta state of M = 128.

The layer's KV heads are grouped by structure (window, sinks, state, gate, scale; the feature dims may
differ inside a group, in head blocks as ``dof_head`` has them); each group is one
:class:`~dofla.models.student_attention.StudentAttention` over its query heads and KV heads, so the layer
makes one kernel call per group, never one per head. Each group keeps exactly its form's state when
decoding: the exact group its own keys and values (:mod:`dofla.attention.exact`), a window group its ring
of recent tokens and sinks, a linear group its fixed state; :class:`MixedState` holds them side by side.
"""
from __future__ import annotations

import torch
from torch import nn

from dofla.models.recurrent_cache import MixedState
from dofla.models.student_attention import StudentAttention


class MixedAttention(nn.Module):
    """One layer of ``parts[g]`` over KV heads ``groups[g]`` (and the query heads that read them)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, groups: list[list[int]],
                 parts: list[StudentAttention]):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.groups = [list(g) for g in groups]
        self.parts = nn.ModuleList(parts)
        for part in parts:
            part.own_kv = True  # an exact group keeps its own keys and values beside the others' states
        group = num_heads // num_kv_heads
        self.query_heads = [[j * group + r for j in kv for r in range(group)] for kv in self.groups]
        self._index: dict[str, tuple] = {}
        # Set by the student model's forward for the duration of a call.
        self.cache_layer = None
        self.key_valid = None

    # what the model, the decode-memory measurement and the trainers read of a layer
    mode = "mixed"
    keeps_kv_cache = False
    softcap = None
    linear_log_scale = None  # the parts' learned scales are trained with their features (``feature_map``)

    @property
    def window(self) -> int:
        """The most tokens a part keeps before its state stops growing (window and sinks)."""
        return max(p.window + p.sinks for p in self.parts)

    @property
    def sinks(self) -> int:
        return 0  # counted in ``window``

    @property
    def feature_map(self) -> nn.ModuleList:
        """What the trainers train as the layer's features: the parts' feature maps (a delta part's with its
        gates) and their learned linear scales."""
        modules = [p.feature_map for p in self.parts if p.feature_map is not None]
        scales = [p.linear_log_scale for p in self.parts if p.linear_log_scale is not None]
        return nn.ModuleList(modules + ([nn.ParameterList(scales)] if scales else []))

    @property
    def gate(self) -> nn.ModuleList | None:
        """The parts' decay gates (None: no part is gated)."""
        gates = [p.gate for p in self.parts if p.gate is not None]
        return nn.ModuleList(gates) if gates else None

    @property
    def num_features(self) -> float:
        group = self.num_heads // self.num_kv_heads
        return sum(p.num_features * len(kv) * group for p, kv in zip(self.parts, self.groups)) / self.num_heads

    def trainable_parts(self) -> list[tuple[StudentAttention, list[int], list[int]]]:
        """(part, its query heads, its KV heads) of each part with features: the layerwise stage trains each
        on its heads' slice of the layer's activations, with the part's window and sinks."""
        return [(p, q, kv) for p, q, kv in zip(self.parts, self.query_heads, self.groups) if p.feature_map is not None]

    def state_bytes(self, tokens: int, kv_bytes: int = 4) -> int:
        return sum(part.state_bytes(tokens, kv_bytes) for part in self.parts)

    def _indices(self, device) -> tuple:
        """(query head index, KV head index) per part and the order that puts the parts' heads back."""
        key = str(device)
        if key not in self._index:
            queries = [torch.tensor(q, device=device) for q in self.query_heads]
            kvs = [torch.tensor(kv, device=device) for kv in self.groups]
            self._index[key] = (queries, kvs, torch.argsort(torch.cat(queries)))
        return self._index[key]

    def forward(self, q, k, v, state: MixedState | None = None, key_valid=None, softcap=None):
        """As :meth:`StudentAttention.forward`: q (B, H, T, d), k, v (B, H_kv, T, d) -> (B, H, T, d), state."""
        queries, kvs, order = self._indices(q.device)
        outs, states = [], []
        for g, part in enumerate(self.parts):
            held = None if state is None else state.parts[g]
            out, new = part(q.index_select(1, queries[g]), k.index_select(1, kvs[g]), v.index_select(1, kvs[g]),
                            held, key_valid, softcap)
            outs.append(out)
            states.append(new)
        return torch.cat(outs, dim=1).index_select(1, order), MixedState(states)


def hybrid_attentions(student) -> list:
    """The student's attentions (each group of a mixed layer one of them) that keep an exact window before a
    linear state of either kind: what the KL stage's window dropout and the linear-part ablation act on."""
    attentions = [part for attn in student.student_attentions()
                  for part in (attn.parts if isinstance(attn, MixedAttention) else (attn,))]
    return [attn for attn in attentions if attn.window > 0 and attn.form.traits.state not in ("kv", "none")]
