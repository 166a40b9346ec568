"""The cache stage: one teacher pass over the distillation tokens -> per-layer q, k, v on disk,
content-addressed (:func:`dofla.stages.keys.cache_fields`) and shared by every run of a sweep."""
from __future__ import annotations

from dofla.cache import build_or_load_cache
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import cache_fields
from dofla.stages.sources import cache_root


def run(ctx: RunContext, data: RunData):
    """The activation cache of ``data.train_tokens`` (built by ``ctx.capture``, or found on disk)."""
    fields = cache_fields(ctx.cfg, data.fingerprint, ctx.train.ledger.cached)
    return build_or_load_cache(ctx.capture, data.train_tokens, fields, cache_root(ctx.cfg))
