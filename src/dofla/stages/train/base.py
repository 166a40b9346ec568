"""What every training mode shares: where this run's layer artifacts live under which settings, and
a layerwise mode's feature maps and trainer config."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dofla import distributed
from dofla.record import write_json
from dofla.stages.context import RunContext
from dofla.stages.keys import layer_meta, layer_settings
from dofla.stages.students import build_feature_maps, layer_dirs, layer_train_config, linear_layers


@dataclass(frozen=True)
class LayerTarget:
    """The layers this job trains (``train.layers`` among those with features), their artifacts' meta
    and settings, the directory it writes and the ones it also reads (:func:`dofla.stages.students.layer_dirs`)."""

    layers: list[int]
    meta: dict
    settings: dict
    directory: Path
    also_read: list[Path]


def layer_target(ctx: RunContext, cache_key: str, dims: list) -> LayerTarget:
    """This run's :class:`LayerTarget`; rank 0 writes ``settings.json`` beside the artifacts (it tells a
    human what a hash directory's name stands for)."""
    cfg = ctx.cfg
    requested = range(len(dims)) if cfg.train.layers is None else cfg.train.layers
    layers = [i for i in requested if i in set(linear_layers(cfg, ctx.geometry))]
    meta, settings = layer_meta(cfg, cache_key), layer_settings(cfg, cache_key, dims)
    directory, *also_read = layer_dirs(cfg, ctx.out_dir, settings)
    if distributed.is_main():
        write_json(directory / "settings.json", settings)
    return LayerTarget(layers, meta, settings, directory, also_read)


def layerwise_setup(ctx: RunContext, dims: list) -> tuple[list, object]:
    """(feature maps on the teacher's device, the trainers' config with the teacher's soft-cap) of a
    layerwise mode: layers train where the teacher runs."""
    device = next(ctx.teacher.parameters()).device
    feature_maps = [None if fm is None else fm.to(device) for fm in build_feature_maps(ctx.cfg, ctx.geometry, dims)]
    return feature_maps, replace(layer_train_config(ctx.cfg), softcap=ctx.geometry.softcap)
