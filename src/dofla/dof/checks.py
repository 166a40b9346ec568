"""Value checks of the ``allocation`` and ``budget`` sections (:mod:`dofla.dof.config`), beside them:
one clear sentence per bad value, before any model loads (:func:`validate_allocation`, part of
:func:`dofla.validate.validate_config`) or once the model's geometry is known
(:func:`validate_allocation_against_model`, part of :func:`dofla.validate.validate_against_model`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dofla.dof.algorithm import GRAM_NORMS, HEAD_AGGREGATES
from dofla.dof.allocate import ALLOCATION_POLICIES
from dofla.dof.allocator import BUDGET_POLICY  # noqa: F401 - registers allocation=budget
from dofla.dof.budget import feature_budget, memory_budget
from dofla.dof.config import MEMORY_BUDGET
from dofla.errors import ConfigError, require
from dofla.value_checks import one_of, positive

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's sections
    from dofla.config import RunConfig

SOFTMAX_RANKS = ("kl", "kl_greedy", "attention_error", "retrieval", "passkey")


def validate_allocation(cfg: RunConfig) -> None:
    """Every check of ``cfg.allocation`` and ``cfg.budget`` that needs no model."""
    a = cfg.allocation
    one_of("allocation.policy", a.policy, ALLOCATION_POLICIES.names())
    one_of("allocation.gram_norm", a.gram_norm, GRAM_NORMS)
    one_of("allocation.head_aggregate", a.head_aggregate, HEAD_AGGREGATES)
    for key, value in [("allocation.lam", a.lam), ("allocation.num_samples", a.num_samples),
                       ("allocation.head_quantum", a.head_quantum), ("budget.multiple", cfg.budget.multiple)]:
        positive(key, value)
    if cfg.budget.value is not None:
        positive("budget.value", cfg.budget.value)
    require(a.head_blocks >= 0, f"allocation.head_blocks={a.head_blocks!r} must be 0 or more")
    require(a.resamples >= 1, f"allocation.resamples={a.resamples} must be 1 (the paper's single J-sample) or more")
    require(a.spread_samples >= 0, f"allocation.spread_samples={a.spread_samples} must be 0 (off) or more")
    if a.policy == "given":
        require(a.dims is not None and len(a.dims) > 0 and all(isinstance(m, int) and m >= 1 for m in a.dims),
                f"allocation.policy=given takes its dims from allocation.dims, one positive feature count per "
                f"layer (e.g. 'allocation.dims=[128,64,64]'); it is {None if a.dims is None else list(a.dims)}")
    if a.policy == "measured":
        require(len(a.measured_dims) > 0 and all(isinstance(m, int) and m >= 1 for m in a.measured_dims),
                f"allocation.measured_dims={list(a.measured_dims)} must be a list of positive feature counts")
        positive("allocation.measured_steps", a.measured_steps)
    _validate_softmax_layers(cfg)
    _validate_memory_budget(cfg)


def _validate_memory_budget(cfg: RunConfig) -> None:
    """allocation=budget and budget=memory go together; the budget's values; what the allocated plan needs."""
    budget, b = cfg.allocation.policy == BUDGET_POLICY, cfg.budget
    require(not budget or b.name == MEMORY_BUDGET, f"allocation=budget spends a memory budget, not budget={b.name}; "
            "add budget=memory with budget.mib=<MiB> (or budget.share=<share of the teacher's KV cache>)")
    require(budget or b.name != MEMORY_BUDGET, f"budget=memory is spent by allocation=budget alone, not "
            f"allocation.policy={cfg.allocation.policy}; add allocation=budget (or choose a feature budget)")
    if not budget:
        return
    require(cfg.attention.plan is None, f"attention.plan={cfg.attention.plan} gives the plan that allocation=budget "
            "would choose; drop one of them")
    try:
        memory_budget(cfg)
    except ValueError as error:
        raise ConfigError(f"budget=memory: {error}") from None
    require(not b.states or cfg.loss.name in ("output", "direct"), f"budget.states={list(b.states)} offers "
            f"gated-delta heads, which have no kernel for loss={cfg.loss.name} to compare; use loss=output or "
            "loss=direct (or budget.states=[] for windows and exact heads alone)")
    for key in ("calibration_seqs", "prompts", "prompt_length"):
        positive(f"budget.{key}", getattr(b, key))
    require(b.repair_rounds >= 0, f"budget.repair_rounds={b.repair_rounds} must be 0 (the check alone) or more")
    longest = max(b.windows, default=0) + b.sinks
    require(cfg.data.seq_len > longest and b.prompt_length > longest, f"the allocator's calibration sequences "
            f"(data.seq_len={cfg.data.seq_len}) and passkey prompts (budget.prompt_length={b.prompt_length}) must be "
            f"longer than the largest window and its sinks ({longest} tokens) to tell it from the others; raise "
            "them or shorten budget.windows")


def _validate_softmax_layers(cfg: RunConfig) -> None:
    a = cfg.allocation
    k = a.softmax_layers
    require(isinstance(k, int) and k >= 0, f"allocation.softmax_layers={k!r} must be 0 or a number of layers")
    positive("allocation.softmax_probe_seqs", a.softmax_probe_seqs)
    one_of("allocation.softmax_rank", a.softmax_rank, SOFTMAX_RANKS)
    require(not k or a.softmax_rank != "passkey" or cfg.eval.passkey_lengths,
            "allocation.softmax_rank=passkey chooses layers on passkey prompts of the longest eval.passkey_lengths, "
            "which is empty; set eval.passkey_lengths (e.g. [1024])")


def validate_allocation_against_model(cfg: RunConfig, num_layers: int, head_dim: int) -> None:
    """The allocation checks that need the model's layers and head size."""
    budget = feature_budget(cfg, head_dim)
    require(budget >= 1, f"budget gives {budget:g} features per layer (budget.value={cfg.budget.value}, "
            f"budget.multiple={cfg.budget.multiple}); it must be at least 1")
    if cfg.allocation.policy == "dof_clip":
        require(
            budget <= head_dim,
            f"allocation.policy=dof_clip caps every layer at the head size {head_dim}, so a budget of "
            f"{budget:g} > {head_dim} cannot be met; use policy dof or a budget ≤ {head_dim}",
        )
    if cfg.allocation.policy == "given":
        require(len(cfg.allocation.dims) == num_layers,
                f"allocation.dims has {len(cfg.allocation.dims)} dims, the model {num_layers} layers: give one per "
                "layer (a layer without features ignores its own)")
    require(cfg.allocation.softmax_layers < num_layers,
            f"allocation.softmax_layers={cfg.allocation.softmax_layers} would keep every layer of the {num_layers} "
            "exact; choose fewer (or feature_map=softmax for the teacher's own attention)")
