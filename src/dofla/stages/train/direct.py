"""The direct mode (``loss=direct``): every layer's features trained at once through the whole
student's next-token loss, on random rows of the cached tokens or on one pass of a stream."""
from __future__ import annotations

from dataclasses import replace

from dofla import distributed
from dofla.artifacts import artifact_problem, save_artifact
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.results import TrainResult
from dofla.stages.sources import stream_steps, training_stream
from dofla.stages.students import layer_features, layer_train_config, make_student, per_layer_meta, trainable
from dofla.stages.train.base import LayerTarget, layer_target
from dofla.train import train_direct


def run(ctx: RunContext, cache, dims: list, data: RunData, on_log=None) -> TrainResult:
    """End-to-end training, skipped when ``direct_done.json`` has our settings and every layer verifies.

    Trains on ``data.train_tokens`` (S, L) (``train.steps`` steps of random rows) from the cache, or
    one pass over ``data.num_tokens`` of a stream after the cached sample. ``direct_done.json``
    records the tokens trained on."""
    target = layer_target(ctx, cache.key, dims)
    student = make_student(ctx.cfg, ctx.teacher, dims)
    done = _stored(target, student)
    if done is not None:
        return TrainResult(direct=done)
    return TrainResult(direct=_train(ctx, student, target, data, on_log))


def _stored(target: LayerTarget, student) -> dict | None:
    """``direct_done.json`` when it has our settings and every trainable layer's artifact verifies."""
    marker = read_json(target.directory / "direct_done.json")
    if marker is None or marker.get("settings") != target.settings:
        return None
    if any(artifact_problem(target.directory / f"layer_{i:02d}.pt", per_layer_meta(target.meta, i, attn))
           for i, attn in enumerate(student.student_attentions()) if trainable(attn)):
        return None
    return marker


def _train(ctx: RunContext, student, target: LayerTarget, data: RunData, on_log) -> dict:
    cfg, directory = ctx.cfg, target.directory
    dcfg = replace(layer_train_config(cfg), batch_size=cfg.train.direct_batch_size)
    batches = data.train_tokens
    if ctx.train.streams:
        batches = training_stream(cfg, ctx.tokenizer, cfg.train.direct_batch_size, ctx.train.ledger.skipped,
                                  source=ctx.data_source)
        dcfg = replace(dcfg, steps=stream_steps(cfg, batches.batch_tokens))
    curve = train_direct(student, batches, dcfg, checkpoint_path=directory / "direct_ckpt.pt", meta=target.settings,
                         on_log=on_log)
    tokens = len(curve) * batches.batch_tokens if ctx.train.streams else data.train_tokens.numel()
    if distributed.is_main():  # under torchrun every rank holds the same features
        for i, attn in enumerate(student.student_attentions()):
            features = layer_features(attn, "plan" in target.meta)
            if features is None:  # a teacher sliding-window layer: kept exact, nothing trained
                continue
            save_artifact(directory / f"layer_{i:02d}.pt", {"state_dict": features.state_dict(),
                                                             "curve": curve}, per_layer_meta(target.meta, i, attn))
        write_json(directory / "direct_done.json", {"settings": target.settings, "steps": len(curve),
                                                    "tokens": tokens, "curve": curve})
    distributed.barrier()
    return read_json(directory / "direct_done.json")
