"""``allocation.softmax_layers=k``: keep exact the k layers whose restoration to softmax lowers the
model's KL the most (:mod:`dofla.dof.softmax_layers`), beside the feature allocation.

It runs inside the assemble stage, once every layer's trained features are loaded and before the
student is saved, so the distill stage trains the student with those layers exact and the saved
student loads with them exact. The measurement depends on the trained layers and the probe, not on
k, so it is stored beside the layers (``softmax_ranking.json`` in their settings directory): runs
sharing ``train.layer_dir`` with another k reuse it (the greedy choice, ``softmax_rank=kl_greedy``,
is extended step by step: a larger k measures only the steps a smaller one did not; so is the
passkey choice, ``softmax_rank=passkey``, kept with the prompts' length, count and seed, so that a
passkey choice with another ``softmax_probe_seqs`` keeps the probe's measurements and the other way
round). The run's choice goes to ``softmax_layers.json``. A training-free ``sliding_window`` student
has no trained layers: its measurement lives in the run's own ``layers/`` (or ``train.layer_dir``'s
settings directory) all the same, keyed by the teacher's data and the window.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dofla.config import RunConfig
from dofla.dof.softmax_layers import (choose, greedy_restoration_kl, greedy_restoration_passkey, kv_bytes_per_token,
                                      passkey_prompts, probe_attention_errors, probe_retrieval, rank_layers,
                                      restoration_kl, restoration_passkey)
from dofla.models import get_adapter, restore_softmax
from dofla.record import read_json, write_json
from dofla.stages.keys import softmax_ranking_settings

logger = logging.getLogger(__name__)

RANKING, CHOICE = "softmax_ranking.json", "softmax_layers.json"


def apply(cfg: RunConfig, student, teacher, probe: torch.Tensor, layers: dict, directory: Path,
          out_dir: Path, tokenizer=None) -> list[int]:
    """Restore the chosen layers of ``student`` to softmax (in place); returns them ([] for k = 0).

    ``probe`` (S, L) training tokens (the first ``allocation.softmax_probe_seqs`` sequences are
    used); ``layers`` the trained layers' settings; ``directory`` where the measurement is kept;
    ``tokenizer`` builds the prompts of ``softmax_rank=passkey``.
    """
    a = cfg.allocation
    if not a.softmax_layers:
        return []
    probe = probe[:a.softmax_probe_seqs]
    measured = measurement(cfg, student, teacher, probe, layers, Path(directory) / RANKING, tokenizer)
    chosen = choose(measured, a.softmax_layers, a.softmax_rank)
    restore_softmax(student, chosen)
    cost = metrics(student)["softmax_layers/kv_bytes_per_token"]
    write_json(out_dir / CHOICE, {"layers": chosen, "rank": a.softmax_rank, "measured": measured,
                                  "ranking": rank_layers(measured, a.softmax_rank), "kv_bytes_per_token": cost})
    if a.softmax_rank == "kl":
        values = ", ".join(f"{measured['restored'][str(i)]:.3f}" for i in chosen)
        why = f"restoring one alone takes the probe KL from {measured['base']:.3f} to {values}"
    elif a.softmax_rank == "kl_greedy":
        values = ", ".join(f"{step['layer']}: {step['kl']:.3f}" for step in measured["greedy"][:a.softmax_layers])
        why = f"chosen one after another, each kept: the probe KL goes from {measured['base']:.3f} to {values}"
    elif a.softmax_rank == "passkey":
        pk = measured["passkey"]
        values = ", ".join(f"{step['layer']}: {step['nll']:.2f}" for step in pk["greedy"][:a.softmax_layers])
        why = (f"chosen one after another by passkey recall, each kept: the answer NLL on {pk['prompts']} prompts "
               f"of {pk['length']} tokens goes from {pk['base']:.2f} nats to {values}")
    elif a.softmax_rank == "retrieval":
        values = ", ".join(f"{measured['retrieval'][str(i)]:.3f}" for i in chosen)
        why = f"the teacher's strongest long-range copying on the probe (attention to the copied token): {values}"
    else:
        values = ", ".join(f"{measured['attention_error'][str(i)]:.3f}" for i in chosen)
        why = f"the largest attention errors on the probe: {values}"
    logger.info(f"dofla: keeping layers {chosen} as exact softmax ({why}); when decoding they keep a KV cache of "
          f"{cost:,} bytes per token of context")
    return chosen


def measurement(cfg: RunConfig, student, teacher, probe: torch.Tensor, layers: dict, path: Path,
                tokenizer=None) -> dict:
    """What ``allocation.softmax_rank`` ranks by, read from ``path`` when it was measured for these
    layers and probe, else measured now and added to it (layer keys are strings, as in JSON)."""
    a = cfg.allocation
    settings, stored = softmax_ranking_settings(cfg, layers), read_json(path) or {}
    old, kept = stored.get("settings"), stored.get("measured") or {}
    # the passkey entry is keyed by its own prompts, not by the probe: it survives another probe count
    same_layers = old is not None and {**old, "probe_seqs": None} == {**settings, "probe_seqs": None}
    if old == settings or (same_layers and a.softmax_rank == "passkey"):
        settings, measured = old, kept
    else:
        measured = {"probe_tokens": int(probe.numel())}
        if same_layers and "passkey" in kept:
            measured["passkey"] = kept["passkey"]
    measures = {"restored": restoration_kl, "attention_error": probe_attention_errors, "retrieval": probe_retrieval}
    if a.softmax_rank == "passkey":
        measured["passkey"] = _passkey(cfg, student, tokenizer, measured.get("passkey"))
        write_json(path, {"settings": settings, "measured": measured})
        return measured
    needed = a.softmax_rank if a.softmax_rank in measures else "restored"  # kl, and kl_greedy's first step
    if needed not in measured:
        measure = measures[needed]
        new = measure(student, teacher, probe, cfg.eval.batch_size)
        measured.update({k: {str(i): x for i, x in v.items()} if isinstance(v, dict) else v for k, v in new.items()})
        write_json(path, {"settings": settings, "measured": measured})
    if a.softmax_rank == "kl_greedy" and len(measured.get("greedy", [])) < a.softmax_layers:
        measured["greedy"] = _greedy(student, teacher, probe, a.softmax_layers, cfg.eval.batch_size, measured)
        write_json(path, {"settings": settings, "measured": measured})
    return measured


def _greedy(student, teacher, probe, k: int, batch_size: int, measured: dict) -> list[dict]:
    """The greedy steps up to ``k``, extending the stored ones; the first step is the best layer of
    the one-at-a-time measurement (the same forwards)."""
    steps = measured.get("greedy") or []
    if not steps:
        first = rank_layers(measured, "kl")[0]
        steps = [{"layer": first, "kl": measured["restored"][str(first)]}]
    return greedy_restoration_kl(student, teacher, probe, k, batch_size, steps)


def _passkey(cfg: RunConfig, student, tokenizer, stored: dict | None) -> dict:
    """The passkey choice's greedy steps up to k, extending ``stored`` when it was measured on the
    same prompts: ``allocation.softmax_probe_seqs`` of the longest ``eval.passkey_lengths``, from ``seed``."""
    a, length = cfg.allocation, max(cfg.eval.passkey_lengths)
    prompts_key = {"length": length, "prompts": a.softmax_probe_seqs, "seed": cfg.seed}
    if not stored or {key: stored.get(key) for key in prompts_key} != prompts_key:
        stored = dict(prompts_key)
    if len(stored.get("greedy", [])) >= a.softmax_layers:
        return stored
    prompts = passkey_prompts(tokenizer, length, a.softmax_probe_seqs, cfg.seed)
    if not stored.get("greedy"):  # the first step and the base NLL from the same forwards
        alone = restoration_passkey(student, prompts)
        first = rank_layers(alone, "kl")[0]  # the lowest NLL restored alone, ties by index
        stored["base"], stored["greedy"] = alone["base"], [{"layer": first, "nll": alone["restored"][first]}]
    stored["greedy"] = greedy_restoration_passkey(student, prompts, a.softmax_layers, stored["greedy"])
    return stored


def metrics(student) -> dict:
    """``softmax_layers/count`` and the KV cache they add per token of context (fp32), for metrics.json."""
    layers = (getattr(student.config, "dofla", None) or {}).get("softmax_layers") or []
    if not layers:
        return {}
    geometry = get_adapter(student).geometry(student.config)
    return {"softmax_layers/count": len(layers),
            "softmax_layers/kv_bytes_per_token": kv_bytes_per_token(len(layers), geometry.num_kv_heads,
                                                                    geometry.head_dim)}
