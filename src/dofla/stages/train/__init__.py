"""The train stage: each layer's features, by the run's training mode (its
:class:`~dofla.stages.plan.TrainPlan`), one module per mode:

- :mod:`~dofla.stages.train.layerwise_cache`: layer by layer from the activation cache;
- :mod:`~dofla.stages.train.layerwise_stream`: every layer at once from a stream of fresh teacher
  activations (``train.source=stream``);
- :mod:`~dofla.stages.train.direct`: the whole student end to end (``loss=direct``).

Each is ``run(ctx, cache, dims, data, on_log) -> TrainResult``.
"""
from __future__ import annotations

from dofla.stages.context import RunContext, RunData
from dofla.stages.results import TrainResult
from dofla.stages.train import direct, layerwise_cache, layerwise_stream


def run(ctx: RunContext, cache, dims: list, data: RunData, tracker=None) -> TrainResult:
    """Train the features of every layer that has them (or the ``train.layers`` subset) the way the
    run's plan says; ``tracker`` gets the live curves (every ``train.log_every`` steps)."""
    mode = direct if ctx.train.direct else layerwise_stream if ctx.train.streams else layerwise_cache
    return mode.run(ctx, cache, dims, data, None if tracker is None else tracker.log)
