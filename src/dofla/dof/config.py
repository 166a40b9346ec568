"""The ``allocation`` and ``budget`` sections of a run: Algorithm 1's settings, the allocation policy
and the feature budget it shares out (:mod:`dofla.dof`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from dofla.section_keys import Keys


@dataclass
class AllocationConfig:
    policy: str = "dof"  # fix | dof | dof_clip | dof_head | fix_max | measured | given
    lam: float = 1e-2
    num_samples: int = 512  # J, vectors per head for Algorithm 1 (the paper does not state its J)
    gram_norm: str = "trace"  # none | J | trace (docs/method.md §4)
    num_tokens: Optional[int] = None  # tokens of the cache used to pool q∪k (None: all)
    head_aggregate: str = "mean"  # a layer's DoF from its heads: mean (steadiest) | max (the paper's) | median
    resamples: int = 16  # J-samples averaged per head (1: the paper's single sample)
    spread_samples: int = 0  # > 0: also estimate each layer's DoF on this many other J-samples (spread)
    measured_dims: List[int] = field(default_factory=lambda: [16, 64, 256])  # measured: M grid per layer
    measured_steps: int = 60  # measured: training steps per (layer, M) point
    head_quantum: int = 8  # dof_head: per-head dims are multiples of this (heads of equal dim share a block)
    head_blocks: int = 2  # dof_head: at most this many blocks (distinct dims) per layer; 0 = no limit
    dims: Optional[List[int]] = None  # given: one feature dimension per layer of the model (an ablation's own)
    # k > 0: keep exact (softmax, with a KV cache) the k layers whose restoration lowers the model's KL
    # most, measured on the first softmax_probe_seqs training sequences (docs/guide/softmax_layers.md)
    softmax_layers: int = 0
    softmax_probe_seqs: int = 8
    softmax_rank: str = "kl"  # kl (each alone) | kl_greedy (chosen kept exact) | attention_error | retrieval | passkey

    # its keys are built field by field (dofla.stages.keys.dof_settings, student_settings)
    KEYS: ClassVar[Keys] = Keys(legacy={"resamples": 1, "softmax_layers": 0, "softmax_probe_seqs": 8,
                                        "softmax_rank": "kl"})


BUDGET_POLICY = "budget"  # allocation=budget: the memory-budget allocator (dofla.dof.allocator), per KV head
MEMORY_BUDGET = "memory"  # budget=memory: the budget it spends, in bytes of decode state


@dataclass
class BudgetConfig:
    """The feature budget C of the per-layer policies (``name``, ``value``, ``multiple``), or, for
    ``budget=memory`` (``allocation=budget``), a memory budget: the fields after ``multiple`` map onto
    :class:`dofla.dof.budget.MemoryBudgetConfig` (:func:`dofla.dof.budget.memory_budget`), plus the
    allocator's repair rounds and its calibration: ``calibration_seqs`` training sequences and ``prompts``
    passkey prompts of ``prompt_length`` tokens."""

    name: str = "head_dim"
    value: Optional[float] = None  # mean feature dimension per layer; None = multiple × head size
    multiple: float = 1.0
    mib: Optional[float] = None  # memory: MiB of decode state per sequence at context tokens ...
    share: Optional[float] = None  # ... or this share of the teacher's KV cache at context
    context: int = 8192
    kv_bytes: int = 4
    exact: bool = True
    windows: List[int] = field(default_factory=lambda: [64, 256, 1024])
    sinks: int = 4
    states: List[int] = field(default_factory=lambda: [32, 64, 128, 256])
    pure_states: bool = True
    kl_weight: float = 1.0
    retrieval_weight: float = 1.0
    copy_weight: float = 0.0
    fit_steps: int = 40
    fit_target: str = "full"
    fit_batch_size: int = 4
    batch_size: int = 2
    seed: int = 0
    reuse_prefix: bool = True
    granularity: str = "head"
    solver: str = "milp"
    estimator: str = "measured"
    state_sizing: str = "measured"
    repair_rounds: int = 0
    calibration_seqs: int = 8
    prompts: int = 8
    prompt_length: int = 2048

    # no artifact key reads this section whole (the allocate stage keys its own); the memory fields came
    # later, so runs recorded without them compare at these values (dofla.report.seeds)
    KEYS: ClassVar[Keys] = Keys(legacy={
        "mib": None, "share": None, "context": 8192, "kv_bytes": 4, "exact": True, "windows": [64, 256, 1024],
        "sinks": 4, "states": [32, 64, 128, 256], "pure_states": True, "kl_weight": 1.0, "retrieval_weight": 1.0,
        "copy_weight": 0.0, "fit_steps": 40, "fit_target": "full", "fit_batch_size": 4, "batch_size": 2, "seed": 0, "reuse_prefix": True,
        "granularity": "head", "solver": "milp", "estimator": "measured", "state_sizing": "measured",
        "repair_rounds": 0,
        "calibration_seqs": 8, "prompts": 8, "prompt_length": 2048})
