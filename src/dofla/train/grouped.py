"""A mixed layer's trained part (:class:`dofla.models.mixed_attention.MixedAttention`): the features of each
group of heads that keeps a linear state, trained on its own heads' slice of the layer's activations with its
own window and sinks. It stands where a uniform layer's feature map stands: the layerwise trainers (cached and
streamed) train it as one unit with one optimiser, its artifact holds its state dict, and loading that state
dict loads every group's features (the modules are the student's own)."""
from __future__ import annotations

from torch import nn

from dofla.feature_maps.blocks import feature_dims


class GroupedFeatures(nn.Module):
    """``parts``: (feature map, its query heads, its KV heads, window, sinks) per group with features."""

    def __init__(self, parts: list[tuple]):
        super().__init__()
        self.parts = nn.ModuleList(fm for fm, *_ in parts)
        self.slices = [(list(q), list(kv), int(window), int(sinks)) for _, q, kv, window, sinks in parts]

    @property
    def num_features(self) -> list:
        """Each group's feature dims (what a layer artifact's meta records of its features)."""
        return [feature_dims(fm) for fm in self.parts]

    @property
    def num_heads(self) -> int:
        """The query heads the groups cover (a mixed layer's exact and window-only heads train nothing)."""
        return sum(len(q) for q, *_ in self.slices)

    def param_groups(self) -> list[dict]:
        """Every group's named Adam groups (``z``, ``alpha``, ``gates``, ...; unnamed ones as ``other``)."""
        out = []
        for fm in self.parts:
            named = getattr(fm, "param_groups", None)
            out += named() if named is not None else [{"name": "other", "params": list(fm.parameters())}]
        return [{"name": g["name"], "params": [p for p in g["params"] if p.requires_grad]} for g in out
                if any(p.requires_grad for p in g["params"])]
