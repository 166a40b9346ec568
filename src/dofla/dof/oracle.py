"""The ``measured`` allocation stage: per-layer loss-vs-M curves on the cached sample, then dims.

For every layer, a fresh feature map is trained briefly (``allocation.measured_steps`` steps of the
run's own loss) at each M of ``allocation.measured_dims``; its held-out loss on cache sequences it
did not train on is one point of the layer's curve. The curves go to
:func:`dofla.dof.measured.allocate_measured`, which shares the same total as ``dof``. The curves
are saved per layer (``measured.json``), so a killed run resumes at the next layer, and the result
records the Spearman correlation of the measured sensitivity with the layer DoF.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from dofla.dof.measured import allocate_measured, fit_monotone, measure_layer_curve, rank_correlation
from dofla.feature_maps import build_layer_feature_map
from dofla.record import read_json, write_json
from dofla.train.layerwise import needs_values


def sensitivity(curve_losses: list[float]) -> float:
    """How much a layer gains from features: its loss at the smallest M minus at the largest."""
    return float(curve_losses[0] - curve_losses[-1])


def measured_curves(cfg, cache, geometry, train_cfg, layers: list[int], path: Path) -> list[list[float]]:
    """Held-out loss per (layer in ``layers``, M in ``allocation.measured_dims``), resumable through ``path``."""
    a = cfg.allocation
    dims = sorted(int(m) for m in a.measured_dims)
    settings = {"dims": dims, "steps": a.measured_steps, "feature_map": cfg.feature_map.name,
                "options": dict(cfg.feature_map.options), "loss": cfg.loss.name, "seed": cfg.seed,
                "cache_key": cache.key, "num_tokens": a.num_tokens}
    saved = read_json(path)
    done = saved["layers"] if saved and saved.get("settings") == settings else {}
    short = replace(train_cfg, steps=a.measured_steps, checkpoint_every=10**9, patience=0,
                    eval_every=a.measured_steps)
    for i in tqdm(layers, desc="measured allocation", unit="layer"):
        if str(i) in done:
            continue
        acts = cache.layer(i)
        seqs = acts.q.shape[0] if a.num_tokens is None else max(2, -(-a.num_tokens // acts.q.shape[2]))
        q, k, v = acts.torch(slice(None, seqs), values=needs_values(train_cfg.loss))

        def make(m: int, layer: int = i):
            return build_layer_feature_map(cfg.feature_map.name, geometry.num_heads, geometry.head_dim, m,
                                           seed=cfg.seed + layer, **cfg.feature_map.options)

        done[str(i)] = measure_layer_curve(make, q, k, dims, short, v=v)
        write_json(path, {"settings": settings, "layers": done})
    return [done[str(i)] for i in layers]


def measured_allocation(cfg, cache, geometry, train_cfg, budget: float, layer_dof, layers: list[int],
                        out_dir: Path) -> dict:
    """Dims of ``layers`` from their measured curves under ``budget`` (mean dim per layer), with the
    curves, each layer's sensitivity and its rank correlation with the layer DoF (when given)."""
    a = cfg.allocation
    dims_grid = sorted(int(m) for m in a.measured_dims)
    losses = measured_curves(cfg, cache, geometry, train_cfg, layers, out_dir / "measured.json")
    curves = [fit_monotone(dims_grid, layer) for layer in losses]
    dims = allocate_measured(curves, budget, min_dim=min(dims_grid), max_dim=max(dims_grid))
    gains = [sensitivity(layer) for layer in losses]
    record = {"measured_dims": dims_grid, "measured_losses": losses, "sensitivity": gains, "dims": dims}
    if layer_dof is not None:
        record["dof_sensitivity_spearman"] = rank_correlation(list(layer_dof), gains)
    return record
