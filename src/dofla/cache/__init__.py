from dofla.cache.store import (
    FORMAT_VERSION,
    ActivationCache,
    CacheError,
    LayerActivations,
    build_or_load_cache,
    cache_key,
    pooled_activations,
    predict_cache_bytes,
    verify_cache,
)
from dofla.cache.teacher_logits import TeacherLogitCache, entry_bytes, row_digest

__all__ = [
    "FORMAT_VERSION", "ActivationCache", "CacheError", "LayerActivations", "TeacherLogitCache", "build_or_load_cache",
    "cache_key", "entry_bytes", "pooled_activations", "predict_cache_bytes", "row_digest", "verify_cache",
]
