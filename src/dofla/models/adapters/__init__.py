from dofla.models.adapters import gpt2, gpt_neox, llama  # noqa: F401  (registration)
from dofla.models.adapters.base import ADAPTERS, Adapter, AttentionGeometry, get_adapter

__all__ = ["ADAPTERS", "Adapter", "AttentionGeometry", "get_adapter"]
