from dofla.dof.algorithm import (
    GRAM_NORMS,
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
    MEASURED_POLICIES,
    PER_HEAD_POLICIES,
    allocate_dims,
    allocate_head_dims,
)

__all__ = [
    "GRAM_NORMS", "check_degenerate", "dof_by_cholesky", "dof_dense_reference", "dof_from_eigenvalues",
    "estimate_layer_dof", "gram_matrix", "sample_pool", "ALLOCATION_POLICIES", "allocate_dims",
    "PER_HEAD_POLICIES", "MEASURED_POLICIES", "allocate_head_dims",
]
