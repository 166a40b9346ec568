"""The eval stage's optional probes: the linear-part ablation, the teacher's attention mass outside
the window, loss by position on long held-out sequences, and the passkey probe.

Each is a measurement of :class:`dofla.stages.eval.Measurements`, keyed by its settings.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING

from dofla.data.prepared import pack_split
from dofla.eval.longctx import losses_by_position, mass_outside_window, passkey_results
from dofla.eval.metrics import attention_errors, heldout_losses
from dofla.models.mixed_attention import hybrid_attentions

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's section
    from dofla.config import RunConfig


@contextmanager
def without_linear_part(student):
    """Within the block, every hybrid layer of ``student`` keeps only its exact window and sinks
    (its feature map is detached, so the layer runs as sliding-window attention)."""
    hybrid = hybrid_attentions(student)
    saved = [attn.feature_map for attn in hybrid]
    try:
        for attn in hybrid:
            attn.feature_map = None
        yield len(hybrid)
    finally:
        for attn, feature_map in zip(hybrid, saved):
            attn.feature_map = feature_map


def ablation_metrics(cfg: RunConfig, teacher, student, heldout_tokens, full: dict) -> dict:
    """The student with its linear part removed: perplexity, attention error, and the differences
    to the full student (``full``: its metrics), i.e. what the linear part contributes."""
    out = {}
    with without_linear_part(student):
        if cfg.eval.perplexity:
            losses = heldout_losses(student, heldout_tokens, cfg.eval.batch_size)
            loss = losses.mean().item()
            out["seq/ablate/student"] = losses.tolist()
            out["ablate/student_loss"] = loss
            out["ablate/student_ppl"] = math.exp(loss) if loss < 700 else float("inf")
            out["ablate/linear_gain_loss"] = loss - full["eval/student_loss"]
        if cfg.eval.attention_error:
            errors = attention_errors(teacher, student, heldout_tokens[: cfg.eval.attn_error_seqs])
            out.update({f"ablate/attn_error/layer_{i:02d}": float(e) for i, e in enumerate(errors)})
            out["ablate/attn_error/mean"] = float(sum(errors) / len(errors))
            out["ablate/linear_gain_attn_error"] = out["ablate/attn_error/mean"] - full["eval/attn_error/mean"]
    return out


def window_mass_metrics(cfg: RunConfig, teacher, heldout_tokens) -> dict:
    """Per layer, the teacher's attention probability outside ``attention.window`` + sinks."""
    masses = mass_outside_window(teacher, heldout_tokens[: cfg.eval.attn_error_seqs], cfg.attention.window,
                                 cfg.attention.sinks)
    out = {f"window_mass/layer_{i:02d}": m for i, m in enumerate(masses)}
    out["window_mass/mean"] = sum(masses) / len(masses)
    return out


def long_tokens(cfg: RunConfig, tokenizer, source):
    """``eval.long_context_seqs`` held-out sequences of ``eval.long_seq_len`` tokens (S, L) of ``source``
    (a data source or prepared tokens)."""
    length = cfg.eval.long_seq_len or cfg.data.seq_len
    return pack_split(source, "heldout", tokenizer, length, cfg.eval.long_context_seqs * length,
                      desc="tokenize long held-out", setting="eval.long_context_seqs")


def position_metrics(cfg: RunConfig, who: str, model, tokens) -> dict:
    """Held-out loss per position bucket ``[edges[b], edges[b+1])`` of ``eval.position_buckets``, and
    (``seq/`` keys) each sequence's."""
    edges = list(cfg.eval.position_buckets)
    losses = losses_by_position(model, tokens, edges)  # (S, buckets)
    out = {}
    for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
        out[f"position/{who}/{lo}-{hi}"] = losses[:, b].mean().item()
        out[f"seq/position/{who}/{lo}-{hi}"] = losses[:, b].tolist()
    return out


def passkey_settings(cfg: RunConfig, model_settings) -> dict:
    """What a stored passkey measurement depends on (``nll``: the answer NLL is part of it)."""
    ev = cfg.eval
    return {"model": model_settings, "lengths": ev.passkey_lengths, "trials": ev.passkey_trials,
            "seed": passkey_seed(cfg), "nll": True}


def passkey_seed(cfg: RunConfig) -> int:
    """The seed the passkey prompts are drawn with: ``eval.passkey_seed``, else the run's seed."""
    return cfg.seed if cfg.eval.passkey_seed is None else cfg.eval.passkey_seed


def passkey_metrics(cfg: RunConfig, who: str, model, tokenizer) -> dict:
    """Passkey retrieval accuracy and answer NLL (nats) per context length in ``eval.passkey_lengths``,
    and (``seq/`` keys) each prompt's."""
    results = passkey_results(model, tokenizer, list(cfg.eval.passkey_lengths), cfg.eval.passkey_trials,
                              passkey_seed(cfg))
    out = {}
    for length, trials in results.items():
        hits, nlls = [float(hit) for hit, _ in trials], [nll for _, nll in trials]
        out[f"passkey/{who}/T{length}"] = sum(hits) / len(hits)
        out[f"passkey_nll/{who}/T{length}"] = sum(nlls) / len(nlls)
        out[f"seq/passkey/{who}/T{length}"] = hits
        out[f"seq/passkey_nll/{who}/T{length}"] = nlls
    return out
