"""The feature budget of a run: the cost C that every allocation policy shares out (the ``budget``
section, :class:`~dofla.dof.config.BudgetConfig`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's section
    from dofla.config import RunConfig


def feature_budget(cfg: RunConfig, head_dim: int) -> float:
    """The cost C: mean feature dimension per layer (``budget.value``, else ``budget.multiple`` × the head size)."""
    return float(cfg.budget.value) if cfg.budget.value is not None else cfg.budget.multiple * head_dim
