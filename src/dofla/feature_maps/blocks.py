"""Per-head feature dimensions without padding: heads of equal dimension form one block.

The paper gives every head of a layer the same feature dimension. With per-head dims (the
``dof_head`` policy), a layer's heads are grouped by dimension and each group gets its own feature
map over just those heads, so a head given 16 features really computes 16, not a padded 128.
:class:`HeadBlockFeatureMap` holds the blocks; :func:`for_each_block` runs a per-block function
and reassembles the heads in their original order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from dofla.attention.linear import LinearState
from dofla.feature_maps.base import FeatureMap, build_feature_map
from dofla.feature_maps.performer import PerformerFeatureMap, prf_log_features

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
    layout = block_layout(feature_map, per_head[0].device)
    states = None if state is None else state.per_block()
    outs, new = [], []
    for b, block in enumerate(feature_map.blocks):
        sub = [None if t is None else t.index_select(1, layout.index[b]) for t in per_head]
        out, block_state = fn(block, *sub, state=None if states is None else states[b])
        outs.append(out)
        new.append(block_state)
    out = torch.cat(outs, dim=1).index_select(1, layout.order)
    return out, BlockState(layout, new) if new[0] is not None else None


@dataclass(frozen=True)
class BlockLayout:
    """Where a layer's blocks sit: index[b] the heads of block b (long, on the data's device),
    order the permutation that puts the blocks' heads back, dims[b] block b's features."""

    index: tuple[torch.Tensor, ...]
    order: torch.Tensor
    dims: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return self.order.numel()


def block_layout(feature_map: HeadBlockFeatureMap, device) -> BlockLayout:
    """The feature map's :class:`BlockLayout` on ``device``, made once per device."""
    cached = feature_map.__dict__.setdefault("_layouts", {})
    if str(device) not in cached:
        index = tuple(torch.tensor(heads, device=device) for heads in feature_map.heads)
        dims = tuple(block.num_features for block in feature_map.blocks)
        cached[str(device)] = BlockLayout(index, torch.argsort(torch.cat(index)), dims)
    return cached[str(device)]


def padded_log_features(feature_map: HeadBlockFeatureMap, x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) -> (B, H, T, M_max): every block's log features in head order, padded to the
    widest block with −inf (features that are exactly 0: they add nothing to any sum)."""
    merged = _merged_prf(feature_map, x.device)
    if merged is not None:  # PRF blocks: one product for every head
        return prf_log_features(x, *merged)
    out = None
    for block, heads in zip(feature_map.blocks, block_layout(feature_map, x.device).index):
        feats = block.log_features(x.index_select(1, heads))
        if out is None:
            out = feats.new_full((*x.shape[:3], max(feature_map.head_dims)), float("-inf"))
        out.narrow(-1, 0, feats.shape[-1]).index_copy_(1, heads, feats)
    return out


def _merged_prf(feature_map: HeadBlockFeatureMap, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """PRF blocks (performer, learned_prf) as one map over every head: z (H, M_max, d) with zero rows
    and log α' (H, M_max) with −inf past each block's width (those features are −inf: exactly 0), and
    log α' = log α + log(M_max / M_b), so that prf_log_features' ½ log(α'/M_max) is each block's
    ½ log(α/M_b). Without autograd it is kept until a parameter changes; None for other maps."""
    blocks = feature_map.blocks
    if not all(isinstance(b, PerformerFeatureMap) for b in blocks):
        return None
    alphas = [b.log_alpha() for b in blocks]
    key = (str(device), tuple((t._version, t.data_ptr()) for b, a in zip(blocks, alphas)
                              for t in (b.z, a) if t is not None))
    cached = feature_map.__dict__.get("_merged_prf")
    if cached is not None and cached[0] == key and not torch.is_grad_enabled():
        return cached[1]
    layout = block_layout(feature_map, device)
    width = max(layout.dims)
    z = blocks[0].z.new_zeros(layout.num_heads, width, feature_map.head_dim)
    log_alpha = z.new_full((layout.num_heads, width), float("-inf"))
    for block, alpha, heads, m in zip(blocks, alphas, layout.index, layout.dims):
        z.narrow(1, 0, m).index_copy_(0, heads, block.z)
        alpha = z.new_zeros(len(heads), m) if alpha is None else alpha
        log_alpha.narrow(1, 0, m).index_copy_(0, heads, alpha + math.log(width / m))
    if not torch.is_grad_enabled():
        feature_map.__dict__["_merged_prf"] = (key, (z, log_alpha))
    return z, log_alpha


class BlockState:
    """Decoding state of a layer with head blocks, in one of two equivalent forms: one state per
    block (what the chunked kernels continue from), or one :class:`~dofla.attention.LinearState`
    over every head with each block's features padded to the widest (``merged``: what token-by-token
    decoding steps, one recurrence for all blocks). Padding features have key log features −inf, so
    their rows of the state stay 0 at the empty state's offset. Each form is built from the other
    when a call needs it; the merged form holds H·M_max features instead of Σ_h M_h."""

    def __init__(self, layout: BlockLayout, blocks: list | None = None, merged=None):
        self.layout = layout
        self._blocks = blocks
        self.merged = merged

    @property
    def blocks(self) -> list:
        return self.per_block()

    def per_block(self) -> list:
        """One state per block (split from the merged form if that is what is held)."""
        if self._blocks is None:
            self._blocks = _split(self.layout, self.merged)
        return self._blocks

    def merge(self):
        """The merged LinearState over all heads (padded from the per-block states if needed)."""
        if self.merged is None:
            self.merged = _merge(self.layout, self._blocks)
        return self.merged

    @property
    def length(self) -> int:
        return (self.merged if self._blocks is None else self._blocks[0]).length

    def index_select(self, index: torch.Tensor) -> "BlockState":
        if self._blocks is None:
            return BlockState(self.layout, merged=self.merged.index_select(index))
        return BlockState(self.layout, [s.index_select(index) for s in self._blocks])

    def nbytes(self) -> int:
        return self.merged.nbytes() if self._blocks is None else sum(s.nbytes() for s in self._blocks)


def _merge(layout: BlockLayout, states: list):
    """Per-block LinearStates -> one over all heads, features padded to the widest block."""
    first = states[0]
    b, dv = first.kv.shape[0], first.kv.shape[-1]
    merged = LinearState.zeros(b, layout.num_heads, max(layout.dims), dv, first.kv.dtype, first.kv.device)
    merged.length = first.length
    for heads, s in zip(layout.index, states):
        m = s.kv.shape[2]
        merged.kv.narrow(2, 0, m).index_copy_(1, heads, s.kv)
        merged.k_sum.narrow(2, 0, m).index_copy_(1, heads, s.k_sum)
        merged.offset.narrow(2, 0, m).index_copy_(1, heads, s.offset)
    return merged


def _split(layout: BlockLayout, merged) -> list:
    """One LinearState over all heads -> per-block states of each block's own width."""
    pick = lambda t, heads, m: t.index_select(1, heads).narrow(2, 0, m)  # noqa: E731
    return [LinearState(pick(merged.kv, heads, m), pick(merged.k_sum, heads, m), pick(merged.offset, heads, m),
                        merged.length) for heads, m in zip(layout.index, layout.dims)]


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


def decode_blocks(feature_map: HeadBlockFeatureMap, q, k, v, state: BlockState, step, **options):
    """One token of a linear layer with head blocks: the blocks' log features padded into one
    (B, H, 1, M_max) pair and one ``step`` (the linear recurrence) over every head on the merged
    state, instead of one step per block. q, k, v (B, H, 1, ·) with GQA keys expanded."""
    log_q, log_k = padded_log_features(feature_map, torch.cat([q, k], dim=2)).split(1, dim=2)  # one call for both
    out, merged = step(log_q, log_k, v, state=state.merge(), **options)
    return out, BlockState(state.layout, merged=merged)
