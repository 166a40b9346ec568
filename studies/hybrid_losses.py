"""Which layerwise loss trains a hybrid layer's linear part? Per-layer attention error on held-out sequences.

``python -m studies.hybrid_losses --run RUN_DIR --layers 0,7,13,25 --out studies/results/hybrid_losses.md``
(or ``--cache CACHE_DIR``). For each layer of a finished run's activation cache it trains a fresh
feature map of ``--features`` per head with each loss in ``--losses`` (the real layerwise trainer,
:func:`dofla.train.layerwise.train_layer`, default settings, ``--steps`` steps) on all but the last
``--eval-seqs`` cached sequences, then measures the hybrid layer's attention-output relative error
on those last sequences (never seen in training or in the trainer's best-state selection),
against two references: the same window + sinks with the linear part removed (``ablated``), and
for ``--window 0`` nothing (pure linear attention). It prints markdown; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from studies.dof_stability import _cache_dir, cache_arguments
from dofla.attention import hybrid_attention_naive, linear_attention_naive, softmax_attention
from dofla.feature_maps import build_feature_map
from dofla.train import LayerTrainConfig, train_layer

LOSS_SPECS = {"softmax": ("softmax", {}), "output": ("output", {}), "l2rows": ("l2", {"scale": "rows"}),
              "l2": ("l2", {})}


def expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


@torch.no_grad()
def attention_error(feature_map, q, k, v, window: int, sinks: int, ablate: bool = False) -> float:
    """Relative error of the student layer's output against softmax attention; q (S, H, L, d),
    k, v expanded to H heads. ``ablate``: the hybrid's exact part only (the linear part removed)."""
    exact = softmax_attention(q, k, v, causal=True)
    log_q, log_k = feature_map.log_features(q), feature_map.log_features(k)
    if window == 0:
        approx = linear_attention_naive(log_q, log_k, v)
    else:
        log_k = log_k - 1e4 if ablate else log_k  # K̂ → 0: window and sinks only
        approx = hybrid_attention_naive(q, k, v, log_q, log_k, window, sinks=sinks)
    return ((approx - exact).norm() / exact.norm()).item()


def measure_layer(q, k, v, losses: list[str], cfg: LayerTrainConfig, features: int, eval_seqs: int,
                  seed: int = 0) -> dict:
    """{"ablated": err, loss: err, ...} for one layer's q (S, H, L, d), k, v (S, H_kv, L, d)."""
    heads, head_dim = q.shape[1], q.shape[-1]
    train, held = slice(None, -eval_seqs), slice(-eval_seqs, None)
    qe, ke, ve = q[held], expand(k[held], heads), expand(v[held], heads)
    make = lambda: build_feature_map("learned_prf", heads, head_dim, features, seed=seed)  # noqa: E731
    row = {}
    if cfg.window > 0:
        row["ablated"] = attention_error(make(), qe, ke, ve, cfg.window, cfg.sinks, ablate=True)
    for name in losses:
        loss, options = LOSS_SPECS[name]
        fm = make()
        train_layer(fm, q[train], k[train], LayerTrainConfig(**{**cfg.__dict__, "loss": loss, "loss_options": options}),
                    v=v[train], desc=name)
        row[name] = attention_error(fm, qe, ke, ve, cfg.window, cfg.sinks)
    return row


def table(rows: dict[int, dict], losses: list[str], window: int) -> str:
    cols = (["ablated"] if window > 0 else []) + losses
    lines = ["| layer | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for i, row in rows.items():
        best = min(row[c] for c in losses)
        cells = [f"**{row[c]:.4f}**" if c in losses and row[c] == best else f"{row[c]:.4f}" for c in cols]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cache_arguments(parser)
    parser.add_argument("--layers", default="0,7,13,25", help="layer indices, comma-separated")
    parser.add_argument("--losses", default="output,softmax,l2rows", help=f"of {', '.join(LOSS_SPECS)}")
    parser.add_argument("--window", type=int, default=64, help="hybrid window (0: pure linear attention)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--features", type=int, default=64, help="learned PRF features per head")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-seqs", type=int, default=2, help="last cached sequences held out for the error")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    losses = args.losses.split(",")
    unknown = sorted(set(losses) - set(LOSS_SPECS))
    if unknown:
        parser.error(f"unknown loss {unknown[0]!r}; choose from {', '.join(LOSS_SPECS)}")

    from dofla.cache import ActivationCache

    cache = ActivationCache(_cache_dir(args))
    cfg = LayerTrainConfig(steps=args.steps, window=args.window, sinks=args.sinks if args.window else 0)
    start, rows = time.perf_counter(), {}
    for i in (int(x) for x in args.layers.split(",")):
        rows[i] = measure_layer(*cache.layer(i).torch(), losses, cfg, args.features, args.eval_seqs)
        print(f"layer {i}: " + ", ".join(f"{c} {e:.4f}" for c, e in rows[i].items()), flush=True)
    kind = f"hybrid, window {args.window} + {cfg.sinks} sinks" if args.window else "pure linear attention"
    text = (f"Attention-output relative error on the last {args.eval_seqs} cached sequences ({kind}, "
            f"learned PRF M = {args.features}, {args.steps} steps, cache {cache.key}; bold: the best loss; "
            f"{time.perf_counter() - start:.0f} s)\n\n" + table(rows, losses, args.window))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
