"""The dof stage: Algorithm 1 on the activation cache -> dof.json.

Each (layer, head)'s degrees of freedom of the attention kernel's integral operator, and one value
per layer; shared across runs through the cache directory, reused only for the same settings
(:func:`dofla.stages.keys.dof_settings`), resumed layer by layer after a kill. Only the layers that
get features are estimated (a teacher's sliding-window layers read ``null``).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from tqdm.auto import tqdm

from dofla.cache import pooled_activations
from dofla.config import RunConfig
from dofla.dof import check_degenerate
from dofla.dof.algorithm import estimate_layer_dof_averaged, layer_dof_spread
from dofla.faults import kill_point
from dofla.record import read_json, write_json
from dofla.stages.context import RunContext
from dofla.stages.keys import dof_settings
from dofla.stages.results import DofResult

logger = logging.getLogger(__name__)


def run(ctx: RunContext, cache, layers: list[int] | None = None) -> DofResult:
    """Algorithm 1 on ``cache`` for ``layers`` (default all) -> ``dof.json``, and the result."""
    cfg, out_dir = ctx.cfg, ctx.out_dir
    settings = dof_settings(cfg, cache.key, layers, cache.meta["num_layers"])
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    shared = Path(cache.path) / f"dof-{digest}.json"
    result = read_json(out_dir / "dof.json")
    if result is None or result.get("settings") != settings:
        result = read_json(shared)
    if result is None or result.get("settings") != settings:
        result = _run_algorithm1(cfg, cache, settings, out_dir / "dof.partial.json")
        write_json(shared, result)
    write_json(out_dir / "dof.json", result)
    if result.get("warning"):
        logger.warning(f"dofla: warning: {result['warning']}")
    return DofResult.of(result)


def _run_algorithm1(cfg: RunConfig, cache, settings: dict, partial_path: Path) -> dict:
    """Per-layer DoF, saved after every layer so a killed run redoes only the layers it lacks."""
    a = cfg.allocation
    partial = read_json(partial_path)
    done = partial["layers"] if partial and partial.get("settings") == settings else {}
    estimated = settings.get("layers", range(cache.meta["num_layers"]))
    for i in tqdm(estimated, desc="dof (Algorithm 1)", unit="layer"):
        if str(i) in done:
            continue
        kill_point(f"dof:layer{i}")
        q, k = pooled_activations(cache, i, a.num_tokens)
        # sample r draws with seed + i + 1000·r: r = 0 is the single-sample estimate
        heads, value, samples = estimate_layer_dof_averaged(
            q, k, a.lam, a.num_samples, a.gram_norm, [cfg.seed + i + 1000 * r for r in range(a.resamples)],
            aggregate=a.head_aggregate)
        done[str(i)] = {"per_head": [float(h) for h in heads], "layer": float(value)}
        if a.resamples > 1:
            done[str(i)]["samples"] = samples
        if a.spread_samples:  # the estimate on other J-samples: how stable the dims built on one sample are
            seeds = [cfg.seed + i + 1000 * (a.resamples + r) for r in range(a.spread_samples)]
            done[str(i)]["spread"] = layer_dof_spread(q, k, a.lam, a.num_samples, a.gram_norm, seeds,
                                                      a.head_aggregate)
        write_json(partial_path, {"settings": settings, "layers": done})
    skipped = {"per_head": None, "layer": None, "samples": None, "spread": None}
    layers = [done.get(str(i), skipped) for i in range(cache.meta["num_layers"])]
    per_layer = [layer["layer"] for layer in layers]
    result = {"settings": settings, "per_head": [layer["per_head"] for layer in layers],
              "layer_dof": per_layer,
              "warning": check_degenerate([n for n in per_layer if n is not None], a.num_samples)}
    if a.resamples > 1:
        result["samples"] = [layer["samples"] for layer in layers]  # each J-sample's layer value
    if a.spread_samples:
        result["spread"] = [layer["spread"] for layer in layers]
    return result
