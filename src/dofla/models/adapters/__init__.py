from dofla.models.adapters import generic, gpt2, gpt_neox  # noqa: F401  (registration)
from dofla.models.adapters.base import (
    ADAPTERS,
    Adapter,
    AttentionGeometry,
    ModelLoadError,
    UnsupportedModelError,
)
from dofla.models.adapters.generic import GenericAdapter
from dofla.models.adapters.support import check_supported, get_adapter, probe_attention_calls

__all__ = [
    "ADAPTERS", "Adapter", "AttentionGeometry", "GenericAdapter", "ModelLoadError", "UnsupportedModelError",
    "check_supported", "get_adapter", "probe_attention_calls",
]
