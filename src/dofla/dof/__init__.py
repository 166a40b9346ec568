from dofla.dof.algorithm import (
    GRAM_NORMS,
    HEAD_AGGREGATES,
    aggregate_heads,
    check_degenerate,
    dof_by_cholesky,
    dof_dense_reference,
    dof_from_eigenvalues,
    estimate_layer_dof,
    gram_matrix,
    sample_pool,
)
from dofla.dof.allocate import (
    ALLOCATION_POLICIES,
    AllocationPolicy,
    AllocationRequest,
    allocate_dims,
    allocate_head_dims,
    choose_dims,
    reads_dof,
)
from dofla.dof.allocator import allocate as allocate_budget
from dofla.dof.budget import MemoryBudgetConfig, budget_bytes, teacher_kv_bytes
from dofla.dof.budget_cost import measurement_counts, timed_estimate
from dofla.dof.first_order import first_order_check, first_order_menu
from dofla.dof.knapsack import solve as solve_knapsack
from dofla.dof.menu import default_menu
from dofla.dof.menu_cache import restore_menu
from dofla.dof.sensitivity import head_values

__all__ = [
    "GRAM_NORMS", "HEAD_AGGREGATES", "aggregate_heads", "check_degenerate", "dof_by_cholesky", "dof_dense_reference", "dof_from_eigenvalues",
    "estimate_layer_dof", "gram_matrix", "sample_pool", "ALLOCATION_POLICIES", "allocate_dims",
    "AllocationPolicy", "AllocationRequest", "allocate_head_dims", "choose_dims", "reads_dof",
    "allocate_budget", "MemoryBudgetConfig", "budget_bytes", "teacher_kv_bytes", "measurement_counts", "timed_estimate",
    "default_menu", "first_order_check", "first_order_menu", "solve_knapsack", "head_values",
    "restore_menu",
]
