"""Layerwise training from a stream (``train.source=stream``): one teacher forward per batch of fresh
text feeds every layer's own loss and optimiser; the cached sample is skipped (the ledger's
``skipped``) and its activations are the held-out set."""
from __future__ import annotations

from dofla import distributed
from dofla.stages.context import RunContext, RunData
from dofla.stages.results import TrainResult
from dofla.stages.sources import stream_steps, training_stream
from dofla.stages.train.base import layer_target, layerwise_setup
from dofla.train.stream import run_streaming
from dofla.train.teacher_acts import cache_heldout


def run(ctx: RunContext, cache, dims: list, data: RunData, on_log=None) -> TrainResult:
    """One pass over ``data.num_tokens`` fresh tokens for every layer of ``train.layers`` with features;
    under torchrun the ranks split every batch (``train.parallel=data``) or the layers."""
    cfg = ctx.cfg
    target = layer_target(ctx, cache.key, dims)
    if not target.layers:
        return TrainResult()
    feature_maps, train_cfg = layerwise_setup(ctx, dims)
    batches = training_stream(cfg, ctx.tokenizer, cfg.train.batch_size, ctx.train.ledger.skipped,
                              source=ctx.data_source)
    held = max(1, round(cfg.train.heldout_fraction * cache.layer(0).q.shape[0]))
    heldout = cache_heldout(cache, num_seqs=held)
    kwargs = dict(num_tokens=cfg.data.num_tokens, steps=stream_steps(cfg, batches.batch_tokens), on_log=on_log)
    split_batches = distributed.splits_batches(cfg.train.parallel, ctx.train.source)
    if distributed.world() > 1 and not split_batches:  # layer i on rank i mod N, then every rank reads them all
        run_streaming(ctx.capture, batches, feature_maps, distributed.mine(target.layers), train_cfg, heldout,
                      target.directory, target.meta, **kwargs)
        distributed.barrier()
    summaries = run_streaming(ctx.capture, batches, feature_maps, target.layers, train_cfg, heldout,
                              target.directory, target.meta, data_parallel=split_batches, **kwargs)
    return TrainResult(summaries=summaries)
