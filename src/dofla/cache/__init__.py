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

__all__ = [
    "FORMAT_VERSION", "ActivationCache", "CacheError", "LayerActivations", "build_or_load_cache",
    "cache_key", "pooled_activations", "predict_cache_bytes", "verify_cache",
]
