"""Layerwise training from the activation cache (``train.source=cache``): each layer's features on
that layer's cached teacher q, k (and v for a loss that reads values), no teacher forward."""
from __future__ import annotations

from dofla import distributed
from dofla.stages.context import RunContext, RunData
from dofla.stages.results import TrainResult
from dofla.stages.train.base import layer_target, layerwise_setup
from dofla.train import run_layerwise
from dofla.train.layerwise import needs_values


def run(ctx: RunContext, cache, dims: list, data: RunData, on_log=None) -> TrainResult:
    """Every layer of ``train.layers`` with features, one ``layer_XX.pt`` each (a verified one is
    loaded, not retrained); under torchrun layer i trains on rank i mod N, then every rank reads them all."""
    target = layer_target(ctx, cache.key, dims)
    if not target.layers:
        return TrainResult()
    feature_maps, train_cfg = layerwise_setup(ctx, dims)
    values = needs_values(train_cfg.loss)  # only the output loss reads v

    def activations(i: int):
        return cache.layer(i).torch(values=values)

    def train(layers, log=None):
        return run_layerwise(feature_maps, activations, layers, train_cfg, target.directory, target.meta,
                             target.also_read, log)

    if distributed.world() == 1:
        return TrainResult(summaries=train(target.layers, on_log))
    train(distributed.mine(target.layers), on_log)
    distributed.barrier()
    return TrainResult(summaries=train(target.layers))
