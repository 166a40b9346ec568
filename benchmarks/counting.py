"""Every op a piece of code runs, counted: FLOPs by the dtype they run in and the bytes each op
writes (:class:`StepCounter`), and, when kept, the ops themselves to replay alone and time. The
cost model (``studies/cost_model.py``) and the kernel's time breakdown (``bench_attention``) use it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_flop_count


def sdpa_cpu(query, key, value, *args, out_val=None, **kwargs) -> int:
    """CPU's fused SDPA has no formula in torch's registry: QKᵀ and PV over the full (L, L)."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


FORMULAS = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu}


@dataclass
class Op:
    kind: str  # the dtype its FLOPs run in ("" for ops without FLOPs)
    flops: int
    written: int  # bytes of its outputs
    call: tuple | None = field(default=None, repr=False)  # (func, args, kwargs, in place?) when kept for replay


class StepCounter(TorchDispatchMode):
    """Every op under it: FLOPs by the dtype of its first tensor input (matmul-like ops: the formulas
    of ``torch.utils.flop_counter``), and the bytes of its outputs (views write nothing). With
    ``keep=True`` each op's call is kept (its inputs stay alive) for :func:`replay`."""

    def __init__(self, keep: bool = False):
        super().__init__()
        self.ops: list[Op] = []
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_place = func._schema.is_mutable
        # an op that writes into its inputs is kept with copies of them as they were, so a replay
        # neither repeats its effect on the real tensors nor sees their later values
        call = (func, *_copies((args, kwargs)), True) if self.keep and in_place else None
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        written = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if self.keep and not in_place:
            call = (func, args, kwargs, False)
        formula = FORMULAS.get(func.overloadpacket)
        if formula is None:
            self.ops.append(Op("", 0, written, call))
        else:
            first = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.ops.append(Op(str(first.dtype).removeprefix("torch."), formula(*args, **kwargs, out_val=out),
                               written, call))
        return out


def _copies(tree):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def replay(ops: list[Op], repeats: int = 3) -> float:
    """Seconds to run ``ops`` (kept calls) one after another with nothing between them, best of
    ``repeats``: what the ops cost without the Python around them. In-place ops get fresh copies of
    their inputs before each repeat (not timed)."""
    best = float("inf")
    for _ in range(repeats):
        calls = [(func, *(_copies((args, kwargs)) if in_place else (args, kwargs)))
                 for func, args, kwargs, in_place in (op.call for op in ops)]
        started = time.perf_counter()
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        best = min(best, time.perf_counter() - started)
    return best
