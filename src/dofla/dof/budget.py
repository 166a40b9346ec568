"""The budgets allocation spends: the feature budget C that every per-layer policy shares out (the
``budget`` section, :class:`~dofla.dof.config.BudgetConfig`), and a memory budget in bytes: the decode state one sequence holds at a context length, for the allocator
(:mod:`dofla.dof.allocator`) to spend head by head.

The budget is given in MiB at ``context`` tokens, or as a ``share`` of the teacher's KV cache at that
context (every head exact: a key and a value of ``kv_bytes`` per number per token). A plan's bytes are
:meth:`dofla.models.plan.StudentPlan.state_bytes` at the same context: the KV cache for exact heads, the
window and sinks for windowed heads, M × d_v for linear states. The menu each KV head chooses from
(:mod:`dofla.dof.menu`), the signals' weights and the measurement's settings live here too, checked before
any model loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dofla.dof.knapsack import MIB
from dofla.dof.sizing import STATE_SIZINGS
from dofla.models.plan import ALL, HeadPlan, StudentPlan

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's section
    from dofla.config import RunConfig


def feature_budget(cfg: RunConfig, head_dim: int) -> float:
    """The cost C: mean feature dimension per layer (``budget.value``, else ``budget.multiple`` × the head size)."""
    return float(cfg.budget.value) if cfg.budget.value is not None else cfg.budget.multiple * head_dim


@dataclass
class MemoryBudgetConfig:
    """``mib`` or ``share`` (one of them) at ``context`` tokens; the menu (``exact``, ``windows`` with
    ``sinks``, each without a state and with a gated-delta state of each M in ``states``, and pure delta
    states when ``pure_states``); the value's weights on the two measured signals (nats of KL per token,
    nats of retrieval NLL per answer) and on the teacher's copying score of the heads an option keeps exact
    (``copy_weight``; 0: unused); ``fit_steps`` of layerwise fitting per linear state measured, each state fitted
    once for every window (``fit_target="full"``) or per option (``"own"``); ``reuse_prefix``: each student
    runs only the layers from its first one that differs from the baseline, the layers before replayed from
    the baseline student's recorded forward (False: every student runs whole): dofla.dof.sensitivity;
    ``granularity``: the unit that chooses an option, a KV head or a whole layer (its KV heads alike: the
    per-layer ablation, a KV-head count fewer students to measure); ``solver``: ``milp`` solves the knapsack of
    the measured values exactly, ``random`` draws a plan at the budget's bytes without measuring the menu
    (the random-plan ablation; the plan itself is still measured)."""

    mib: float | None = None
    share: float | None = None
    context: int = 8192
    kv_bytes: int = 4
    exact: bool = True
    windows: list = field(default_factory=lambda: [64, 256, 1024])
    sinks: int = 4
    states: list = field(default_factory=lambda: [32, 64, 128, 256])
    pure_states: bool = True
    kl_weight: float = 1.0
    retrieval_weight: float = 1.0
    copy_weight: float = 0.0  # × the teacher's copying score of a head where the option keeps it exact
    fit_steps: int = 40
    fit_target: str = "full"  # full: one fit per state, against the full attention, for every window; own
    fit_batch_size: int = 4
    feature_map: str = "learned_prf"
    batch_size: int = 2
    seed: int = 0
    reuse_prefix: bool = True
    granularity: str = "head"  # head: every KV head chooses its option; layer: all KV heads of a layer one option
    solver: str = "milp"  # milp: the exact optimum of the measured values; random: the ablation's random plan
    # measured: every unit and option run as a student; first_order: predicted from one backward of the
    # baseline (dofla.dof.first_order), the chosen plan still measured
    estimator: str = "measured"
    # who sizes each linear state: measured (the values' choice of M), dof (M in proportion to the unit's
    # DoF, one scale for all) or uniform (one M for all): dofla.dof.sizing
    state_sizing: str = "measured"

    def __post_init__(self):
        self.windows = [int(w) for w in self.windows]
        self.states = [int(m) for m in self.states]
        check_budget_config(self)


# the budget section's fields that are MemoryBudgetConfig's own (the rest: the run's calibration and repairs)
MEMORY_FIELDS = ("mib", "share", "context", "kv_bytes", "exact", "windows", "sinks", "states", "pure_states",
                 "kl_weight", "retrieval_weight", "copy_weight", "fit_steps", "fit_target", "fit_batch_size", "batch_size", "seed",
                 "reuse_prefix", "granularity", "solver", "estimator", "state_sizing")


def memory_budget(cfg: RunConfig) -> MemoryBudgetConfig:
    """The run's ``budget=memory`` section as the allocator's config; its linear states are fitted with the
    run's feature map (the student's). Raises ValueError (one sentence) for a bad value."""
    b = cfg.budget
    return MemoryBudgetConfig(**{k: getattr(b, k) for k in MEMORY_FIELDS}, feature_map=cfg.feature_map.name)


def check_budget_config(cfg: MemoryBudgetConfig) -> None:
    """One sentence per user error, before any model loads."""
    if (cfg.mib is None) == (cfg.share is None):
        raise ValueError("give the budget as mib (MiB per sequence at context) or as share (of the teacher's KV "
                         "cache at context), exactly one of them")
    if cfg.mib is not None and not cfg.mib > 0:
        raise ValueError(f"budget mib={cfg.mib} must be a positive number of MiB per sequence")
    if cfg.share is not None and not cfg.share > 0:
        raise ValueError(f"budget share={cfg.share} must be a positive share of the teacher's KV cache (1: all of it)")
    if cfg.context < 1:
        raise ValueError(f"budget context={cfg.context} must be a positive number of tokens")
    if cfg.kv_bytes not in (1, 2, 4, 8):
        raise ValueError(f"kv_bytes={cfg.kv_bytes} must be the bytes of one cached number: 1, 2, 4 or 8")
    if any(w < 1 for w in cfg.windows) or cfg.sinks < 0:
        raise ValueError(f"windows={cfg.windows} must be positive token counts and sinks={cfg.sinks} ≥ 0")
    if any(m < 1 for m in cfg.states):
        raise ValueError(f"states={cfg.states} must be positive feature dims M of the delta state")
    if not cfg.exact and not cfg.windows:
        raise ValueError("the menu needs an option without a linear state (exact or a window) as the baseline the "
                         "others are measured against; set exact=true or give windows")
    weights = {"kl_weight": cfg.kl_weight, "retrieval_weight": cfg.retrieval_weight, "copy_weight": cfg.copy_weight}
    if min(weights.values()) < 0 or sum(weights.values()) == 0:
        raise ValueError(", ".join(f"{k}={v}" for k, v in weights.items()) + " must be ≥ 0 and not all 0")
    if cfg.fit_target not in ("full", "own"):
        raise ValueError(f"fit_target={cfg.fit_target!r} must be 'full' (one fit per state for every window) or "
                         "'own' (each option fitted with its window)")
    if cfg.estimator not in ("measured", "first_order"):
        raise ValueError(f"estimator={cfg.estimator!r} must be 'measured' (every option run as a student) or "
                         "'first_order' (predicted from one backward of the baseline student)")
    if cfg.granularity not in ("head", "layer"):
        raise ValueError(f"granularity={cfg.granularity!r} must be 'head' (each KV head its option) or 'layer' "
                         "(a layer's KV heads one option)")
    if cfg.solver not in ("milp", "random"):
        raise ValueError(f"solver={cfg.solver!r} must be 'milp' (the measured values' optimum) or 'random' (a random "
                         "plan at the budget's bytes)")
    if cfg.state_sizing not in STATE_SIZINGS:
        raise ValueError(f"state_sizing={cfg.state_sizing!r} must be 'measured' (the values choose each state's M), "
                         "'dof' (M in proportion to each unit's DoF) or 'uniform' (one M for every state)")
    if cfg.solver == "random" and cfg.state_sizing != "measured":
        raise ValueError(f"solver=random draws the plan without the measured values, so state_sizing="
                         f"{cfg.state_sizing} has nothing to size; use state_sizing=measured with it")
    if cfg.fit_steps < 0 or cfg.batch_size < 1 or cfg.fit_batch_size < 1:
        raise ValueError("fit_steps must be ≥ 0 and batch_size, fit_batch_size ≥ 1")


def teacher_kv_bytes(geometry, context: int, kv_bytes: int = 4) -> int:
    """The teacher's KV cache of one sequence at ``context`` tokens: every head exact."""
    layers = [tuple(HeadPlan(window=ALL) for _ in range(geometry.num_kv_heads))] * geometry.num_layers
    return plan_bytes(StudentPlan(layers), geometry, context, kv_bytes)


def plan_bytes(plan: StudentPlan, geometry, context: int, kv_bytes: int = 4) -> int:
    """A plan's decode state of one sequence at ``context`` tokens."""
    return plan.state_bytes(geometry.num_heads // geometry.num_kv_heads, geometry.head_dim, context, kv_bytes)


def budget_bytes(cfg: MemoryBudgetConfig, geometry) -> int:
    """The budget in bytes for a teacher of ``geometry``."""
    if cfg.mib is not None:
        return int(cfg.mib * MIB)
    return int(cfg.share * teacher_kv_bytes(geometry, cfg.context, cfg.kv_bytes))
