"""The pipeline's stages, one module each; :mod:`dofla.pipeline` calls them in order.

Each stage is ``run(ctx, inputs) -> result``: ``ctx`` is the frozen :class:`~dofla.stages.context.RunContext`
(config, run directory, teacher, tokenizer, geometry, plan), the inputs are earlier stages' results.
A stage writes one artifact that records the settings it was made with (:mod:`dofla.stages.keys`) and
reuses it only for the same settings, so re-running a command resumes and never returns a stale result.
This package imports nothing at import time: ``dofla.stages.plan`` is light and used by validation.
"""
