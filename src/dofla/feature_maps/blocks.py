"""Per-head feature dimensions without padding: heads of equal dimension form one block.

The paper gives every head of a layer the same feature dimension. With per-head dims (the
``dof_head`` policy), a layer's heads are grouped by dimension and each group gets its own feature
map over just those heads, so a head given 16 features really computes 16, not a padded 128.
:class:`HeadBlockFeatureMap` holds the blocks; :func:`for_each_block` runs a per-block function
and reassembles the heads in their original order.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from dofla.feature_maps.base import FeatureMap, build_feature_map

# A layer's dimension: one int for every head (the paper's), or one int per head.
LayerDims = int | Sequence[int]


class HeadBlockFeatureMap(nn.Module):
    """A layer's feature maps for per-head dims: block b covers ``heads[b]`` with ``dims[b]`` features."""

    def __init__(self, name: str, head_dims: Sequence[int], head_dim: int, seed: int = 0, **options):
        super().__init__()
        self.head_dims = [int(m) for m in head_dims]
        self.num_heads = len(self.head_dims)
        self.head_dim = head_dim
        by_dim: dict[int, list[int]] = {}
        for head, m in enumerate(self.head_dims):
            by_dim.setdefault(m, []).append(head)
        self.heads = [by_dim[m] for m in sorted(by_dim)]
        self.blocks = nn.ModuleList(
            build_feature_map(name, len(heads), head_dim, m, seed=seed + 1000 * b, **options)
            for b, (m, heads) in enumerate(sorted(by_dim.items()))
        )

    @property
    def num_features(self) -> float:
        """Mean features per head (what the budget counts)."""
        return sum(self.head_dims) / self.num_heads

    def param_groups(self) -> list[dict]:
        """The blocks' named Adam groups merged by name (z, alpha, ...)."""
        merged: dict[str, list] = {}
        for block in self.blocks:
            named = getattr(block, "param_groups", None)
            groups = named() if named is not None else [{"name": "other", "params": list(block.parameters())}]
            for g in groups:
                merged.setdefault(g["name"], []).extend(p for p in g["params"] if p.requires_grad)
        return [{"name": n, "params": ps} for n, ps in merged.items() if ps]

    def extra_repr(self) -> str:
        return f"head_dims={self.head_dims}"


def build_layer_feature_map(name: str, num_heads: int, head_dim: int, dims: LayerDims, seed: int = 0,
                            **options) -> FeatureMap | HeadBlockFeatureMap:
    """One layer's feature map: a plain one for an int dim, blocks for per-head dims."""
    if isinstance(dims, (int, float)):
        return build_feature_map(name, num_heads, head_dim, int(dims), seed=seed, **options)
    if len(dims) != num_heads:
        raise ValueError(f"per-head dims has {len(dims)} entries but the layer has {num_heads} heads")
    if len(set(dims)) == 1:  # one block: the plain map, same parameters and cost
        return build_feature_map(name, num_heads, head_dim, int(dims[0]), seed=seed, **options)
    return HeadBlockFeatureMap(name, dims, head_dim, seed=seed, **options)


def blocks(feature_map) -> list[tuple[FeatureMap, list[int] | None]]:
    """(block map, its head indices) pairs; a plain map is one block over all heads (None)."""
    if isinstance(feature_map, HeadBlockFeatureMap):
        return list(zip(feature_map.blocks, feature_map.heads))
    return [(feature_map, None)]


def for_each_block(feature_map, fn: Callable, *per_head: torch.Tensor, state=None):
    """Run ``fn(block_map, *tensors_of_its_heads, state=block_state) -> (out, state)`` per block.

    ``per_head`` tensors are (B, H, ...) with every query head's data (GQA keys already expanded);
    a None among them is passed on as None.
    A plain feature map is one block. Outputs are put back in head order; states come back as a
    :class:`BlockState` (one per block) for decoding.
    """
    if not isinstance(feature_map, HeadBlockFeatureMap):
        return fn(feature_map, *per_head, state=state)
    outs, states = [], []
    for b, (block, heads) in enumerate(blocks(feature_map)):
        index = torch.tensor(heads, device=per_head[0].device)
        sub = [None if t is None else t.index_select(1, index) for t in per_head]
        out, block_state = fn(block, *sub, state=None if state is None else state.blocks[b])
        outs.append(out)
        states.append(block_state)
    order = torch.tensor([h for heads in feature_map.heads for h in heads], device=outs[0].device)
    out = torch.cat(outs, dim=1).index_select(1, torch.argsort(order))
    return out, BlockState(states) if states[0] is not None else None


class BlockState:
    """Decoding state of a layer with head blocks: one state per block, same interface."""

    def __init__(self, blocks: list):
        self.blocks = blocks

    @property
    def length(self) -> int:
        return self.blocks[0].length

    def index_select(self, index: torch.Tensor) -> "BlockState":
        return BlockState([s.index_select(index) for s in self.blocks])

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.blocks)


def feature_dims(feature_map) -> int | list[int]:
    """What identifies a layer's feature sizes: its dim, or its per-head dims."""
    if isinstance(feature_map, HeadBlockFeatureMap):
        return list(feature_map.head_dims)
    return feature_map.num_features


def mean_dim(dims: Sequence[LayerDims]) -> float:
    """Mean feature dimension per head over all layers (the budget's unit)."""
    return sum(layer_mean_dim(d) for d in dims) / len(dims)


def layer_mean_dim(dims: LayerDims) -> float:
    return float(dims) if isinstance(dims, (int, float)) else sum(dims) / len(dims)
