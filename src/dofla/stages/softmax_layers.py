"""``allocation.softmax_layers=k``: keep exact the k layers whose restoration to softmax lowers the
model's KL the most (:mod:`dofla.dof.softmax_layers`), beside the feature allocation.

It runs inside the assemble stage, once every layer's trained features are loaded and before the
student is saved, so the distill stage trains the student with those layers exact and the saved
student loads with them exact. The measurement depends on the trained layers and the probe, not on
k, so it is stored beside the layers (``softmax_ranking.json`` in their settings directory): runs
sharing ``train.layer_dir`` with another k reuse it. The run's choice goes to ``softmax_layers.json``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dofla.artifacts import canonical
from dofla.config import RunConfig
from dofla.record import read_json, write_json

RANKING, CHOICE = "softmax_ranking.json", "softmax_layers.json"


def probe_settings(cfg: RunConfig, layers: dict) -> dict:
    """What the per-layer measurement depends on: the trained layers (their settings name the data
    and the cache the probe comes from) and the probe's size."""
    return canonical({"layers": layers, "probe_seqs": cfg.allocation.softmax_probe_seqs})


def apply(cfg: RunConfig, student, teacher, probe: torch.Tensor, layers: dict, directory: Path,
          out_dir: Path) -> list[int]:
    """Restore the chosen layers of ``student`` to softmax (in place); returns them ([] for k = 0).

    ``probe`` (S, L) training tokens (the first ``allocation.softmax_probe_seqs`` sequences are
    used); ``layers`` the trained layers' settings; ``directory`` where the measurement is kept.
    """
    from dofla.dof.softmax_layers import choose, kv_bytes_per_token, rank_layers, restoration_kl
    from dofla.models import get_adapter, restore_softmax

    k = cfg.allocation.softmax_layers
    if not k:
        return []
    settings, path = probe_settings(cfg, layers), Path(directory) / RANKING
    stored = read_json(path) or {}
    if stored.get("settings") == settings:
        measured = stored["measured"]
    else:
        measured = restoration_kl(student, teacher, probe[:cfg.allocation.softmax_probe_seqs], cfg.eval.batch_size)
        measured = {"base": measured["base"], "restored": {str(i): v for i, v in measured["restored"].items()},
                    "probe_tokens": int(probe[:cfg.allocation.softmax_probe_seqs].numel())}
        write_json(path, {"settings": settings, "measured": measured, "ranking": rank_layers(measured)})
    chosen = choose(measured, k)
    restore_softmax(student, chosen)
    geometry = get_adapter(teacher).geometry(teacher.config)
    cost = kv_bytes_per_token(len(chosen), geometry.num_kv_heads, geometry.head_dim)
    restored = {i: measured["restored"][str(i)] for i in chosen}
    write_json(out_dir / CHOICE, {"layers": chosen, "base_kl": measured["base"], "kl_with_layer_restored": restored,
                                  "ranking": rank_layers(measured), "kv_bytes_per_token": cost,
                                  "probe_tokens": measured["probe_tokens"]})
    print(f"dofla: keeping layers {chosen} as exact softmax (restoring one alone takes the probe KL from "
          f"{measured['base']:.3f} to {', '.join(f'{v:.3f}' for v in restored.values())}); when decoding they keep "
          f"a KV cache of {cost:,} bytes per token of context", flush=True)
    return chosen


def metrics(student) -> dict:
    """``softmax_layers/count`` and the KV cache they add per token of context (fp32), for metrics.json."""
    from dofla.dof.softmax_layers import kv_bytes_per_token
    from dofla.models import get_adapter

    layers = (getattr(student.config, "dofla", None) or {}).get("softmax_layers") or []
    if not layers:
        return {}
    geometry = get_adapter(student).geometry(student.config)
    return {"softmax_layers/count": len(layers),
            "softmax_layers/kv_bytes_per_token": kv_bytes_per_token(len(layers), geometry.num_kv_heads,
                                                                    geometry.head_dim)}
