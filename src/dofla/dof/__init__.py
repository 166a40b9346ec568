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

__all__ = [
    "GRAM_NORMS", "HEAD_AGGREGATES", "aggregate_heads", "check_degenerate", "dof_by_cholesky", "dof_dense_reference", "dof_from_eigenvalues",
    "estimate_layer_dof", "gram_matrix", "sample_pool", "ALLOCATION_POLICIES", "allocate_dims",
    "AllocationPolicy", "AllocationRequest", "allocate_head_dims", "choose_dims", "reads_dof",
]
