"""The cache stage: one teacher pass over the distillation tokens -> per-layer q, k, v on disk,
content-addressed (:func:`dofla.stages.keys.cache_fields`) and shared by every run of a sweep."""
from __future__ import annotations

from pathlib import Path

from dofla.config import RunConfig
from dofla.stages.context import RunContext, RunData
from dofla.stages.data import cached_tokens
from dofla.stages.keys import cache_fields


def run(ctx: RunContext, data: RunData):
    """The activation cache of ``data.train_tokens`` (built by ``ctx.capture``, or found on disk)."""
    from dofla.cache import build_or_load_cache

    fields = cache_fields(ctx.cfg, data.fingerprint, cached_tokens(ctx.cfg, ctx.source))
    return build_or_load_cache(ctx.capture, data.train_tokens, fields, cache_root(ctx.cfg))


def cache_root(cfg: RunConfig) -> Path:
    """Where activation caches live: ``paths.cache_dir``, else DOFLA_CACHE_DIR or the user cache."""
    from dofla.models import cache_root as default_root

    return Path(cfg.paths.cache_dir).expanduser() if cfg.paths.cache_dir else default_root() / "activations"
