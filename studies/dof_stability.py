"""How stable are Algorithm 1's per-layer DoF, and the ``dof`` dims built on them, across J-samples?

``python -m studies.dof_stability --cache CACHE_DIR --out studies/results/dof_stability.md``
(or ``--run RUN_DIR`` to find the cache from a finished run's ``run.json``). For every J in
``--samples`` it estimates each layer's per-head DoF on R independent J-samples (resample r of
layer i uses seed ``1000·r + i``; r = 0 is the sample the ``dof`` stage draws at seed 0), then for
every head aggregation turns each resample's DoF profile into dims with the real ``dof`` policy
(:func:`dofla.dof.allocate.allocate_dims`, same rounding and budget) and reports how much each
layer's DoF and dim move between resamples. It prints markdown; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from dofla.dof import HEAD_AGGREGATES, aggregate_heads, allocate_dims, estimate_layer_dof

TOLERANCE = 0.10  # a dim is "stable" when every resample lies within ±10 % of its mean
MOST = 0.8  # "most layers": at least this share of them stable


def resample_per_head(q, k, lam: float, num_samples: int, gram_norm: str, resamples: int,
                      layer: int = 0, seeds: list[int] | None = None) -> np.ndarray:
    """(R, H) per-head DoF of one layer on R J-samples; q (N, H, d), k (N', H_kv, d).

    The seeds are ``1000·r + layer`` unless ``seeds`` (R of them) is given.
    """
    seeds = seeds if seeds is not None else [1000 * r + layer for r in range(resamples)]
    return np.array([estimate_layer_dof(q, k, lam, num_samples, gram_norm, seed)[0] for seed in seeds])


def rel_spread(x: np.ndarray) -> np.ndarray:
    """(R, L) -> (L,): (max − min) / mean over the resamples (0 where the mean is 0)."""
    mean = x.mean(0)
    return np.where(mean > 0, (x.max(0) - x.min(0)) / np.where(mean > 0, mean, 1), 0.0)


def within(x: np.ndarray, tol: float = TOLERANCE) -> np.ndarray:
    """(R, L) -> (L,) bool: every resample within ±``tol`` of the layer's mean over resamples."""
    mean = x.mean(0)
    return np.abs(x - mean).max(0) <= tol * np.abs(mean) + 1e-12


def stability(per_head: np.ndarray, aggregate: str, budget: float, head_dim: int, policy: str = "dof") -> dict:
    """Per-layer DoF and dims across resamples, and their spread.

    per_head (R, L, H): per-head DoF of each resample and layer. Returns ``dof`` and ``dims``
    (R, L) arrays, per-layer ``dof_mean``, ``dof_std``, ``dof_spread``, ``dim_mean``,
    ``dim_spread`` (L,) and the summary ``median_dim_spread``, ``max_dim_spread``, ``share_within``.
    """
    dof = np.array([[aggregate_heads(list(heads), aggregate) for heads in sample] for sample in per_head])
    dims = np.array([allocate_dims(list(row), budget, policy, head_dim) for row in dof], dtype=float)
    spread = rel_spread(dims)
    return {"dof": dof, "dims": dims, "dof_mean": dof.mean(0), "dof_std": dof.std(0, ddof=1) if len(dof) > 1
            else np.zeros(dof.shape[1]), "dof_spread": rel_spread(dof), "dim_mean": dims.mean(0),
            "dim_spread": spread, "median_dim_spread": float(np.median(spread)),
            "max_dim_spread": float(spread.max()), "share_within": float(within(dims).mean())}


def average_groups(per_head: np.ndarray, average: int) -> np.ndarray:
    """(R, L, H) -> (R // average, L, H): each estimate the mean of ``average`` consecutive J-samples
    (what ``allocation.resamples=average`` computes); leftover samples are dropped."""
    groups = per_head.shape[0] // average
    if groups < 1:
        raise ValueError(f"{per_head.shape[0]} resamples cannot make one average of {average}")
    return per_head[: groups * average].reshape(groups, average, *per_head.shape[1:]).mean(1)


def measure(layers: list, lam: float, samples: list[int], resamples: dict[int, int], gram_norm: str,
            budget: float, head_dim: int, aggregates=HEAD_AGGREGATES, done=None, average: int = 1) -> list[dict]:
    """One summary row per (J, aggregation) over ``layers``, a list of (index, q, k).

    With ``average`` > 1 every estimate is the mean of that many J-samples, so R resamples give
    R // average estimates to compare.

    ``resamples`` maps J to its R. Each row carries its ``stability`` dicts (all R resamples, and
    the first two) and the CPU seconds per estimate at that J (shared by its aggregations: they read the
    same per-head estimates). J runs smallest first; ``done(rows)`` is called after each J, so a
    long run keeps what it finished.
    """
    rows = []
    for j in samples:
        start = time.process_time()  # CPU time: wall time on a shared machine measures the others
        per_head = []
        for i, q, k in layers:
            print(f"J={j} layer {i}", file=sys.stderr, flush=True)
            per_head.append(resample_per_head(q, k, lam, j, gram_norm, resamples[j], layer=i))
        seconds = time.process_time() - start
        stacked = average_groups(np.stack(per_head, axis=1), average)  # (R // average, L, H)
        for aggregate in aggregates:
            rows.append({"J": j, "aggregate": aggregate, "R": len(stacked), "average": average,
                         "seconds": seconds / len(stacked),
                         "stats": stability(stacked, aggregate, budget, head_dim),
                         "stats_r2": stability(stacked[:2], aggregate, budget, head_dim)})
        if done is not None:
            done(rows)
    return rows


def pick(rows: list[dict], most: float = MOST) -> dict | None:
    """The cheapest (smallest J, then smallest median dim spread) row stable in ≥ ``most`` of layers."""
    ok = [r for r in rows if r["stats"]["share_within"] >= most]
    return min(ok, key=lambda r: (r["J"], r["stats"]["median_dim_spread"])) if ok else None


def summary_table(rows: list[dict]) -> str:
    lines = ["| J | aggregation | R | median dim spread | max dim spread | layers within ±10 % | "
             "median dim spread (R=2) | median DoF spread | CPU s per estimate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["stats"]
        mean_of = f" (each the mean of {r['average']})" if r.get("average", 1) > 1 else ""
        lines.append(f"| {r['J']} | {r['aggregate']} | {r['R']}{mean_of} | {s['median_dim_spread']:.3f} | "
                     f"{s['max_dim_spread']:.3f} | {s['share_within']:.0%} | "
                     f"{r['stats_r2']['median_dim_spread']:.3f} | {np.median(s['dof_spread']):.3f} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def layer_table(row: dict) -> str:
    s = row["stats"]
    lines = [f"Per layer, J={row['J']}, aggregation={row['aggregate']}, R={row['R']}:", "",
             "| layer | DoF mean | DoF std | DoF spread | dim mean | dim min–max | dim spread |",
             "|---|---|---|---|---|---|---|"]
    for i in range(len(s["dof_mean"])):
        lines.append(f"| {i} | {s['dof_mean'][i]:.2f} | {s['dof_std'][i]:.2f} | {s['dof_spread'][i]:.3f} | "
                     f"{s['dim_mean'][i]:.1f} | {s['dims'][:, i].min():.0f}–{s['dims'][:, i].max():.0f} | "
                     f"{s['dim_spread'][i]:.3f} |")
    return "\n".join(lines)


def _cache_dir(args) -> Path:
    if args.cache:
        return Path(args.cache)
    from dofla.models import cache_root
    from dofla.report import load_run, run_config

    cache_dir = run_config(Path(args.run)).paths.cache_dir
    return Path(cache_dir or cache_root() / "activations") / load_run(Path(args.run))["record"]["cache_key"]


def _layers(cache, indices: list[int], num_tokens: int | None):
    from dofla.cache import pooled_activations  # exactly the pool the dof stage samples from

    for i in indices:
        q, k = pooled_activations(cache, i, num_tokens)
        yield i, q, k


def cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cache DIR`` or ``--run RUN_DIR`` (exactly one): where the activation cache is."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", help="activation cache directory (holds meta.json and layer_*_q.npy)")
    where.add_argument("--run", help="a finished run directory whose run.json names the cache")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cache_arguments(parser)
    parser.add_argument("--samples", default="256,512,1024,2048", help="J values, comma-separated")
    parser.add_argument("--resamples", type=int, default=6, help="R, J-samples per setting")
    parser.add_argument("--large", type=int, default=2048, help="J from which --large-resamples applies")
    parser.add_argument("--large-resamples", type=int, default=2, help="R for J ≥ --large (cost grows as J³)")
    parser.add_argument("--layers", default=None, help="layer indices, comma-separated (default: all)")
    parser.add_argument("--lam", type=float, default=0.01)
    parser.add_argument("--gram-norm", default="trace")
    parser.add_argument("--num-tokens", type=int, default=None, help="cache tokens pooled (default: all)")
    parser.add_argument("--budget", type=float, default=None, help="mean dim per layer (default: head size)")
    parser.add_argument("--average", type=int, default=1,
                        help="each estimate is the mean of this many J-samples (allocation.resamples); "
                             "R resamples give R // average estimates")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)

    from dofla.cache import ActivationCache

    cache = ActivationCache(_cache_dir(args))
    meta = cache.meta
    indices = [int(x) for x in args.layers.split(",")] if args.layers else list(range(meta["num_layers"]))
    samples = sorted(int(x) for x in args.samples.split(","))
    resamples = {j: args.large_resamples if j >= args.large else args.resamples for j in samples}
    if min(resamples.values()) < 2 * args.average:
        sys.exit("need at least 2 estimates per J to measure a spread (2 × --average resamples); "
                 "raise --resamples / --large-resamples")
    budget = args.budget or float(meta["head_dim"])
    start = time.perf_counter()

    def done(rows: list[dict]) -> None:
        text = report(rows, cache, args, budget, len(indices), time.perf_counter() - start)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")

    measure(list(_layers(cache, indices, args.num_tokens)), args.lam, samples, resamples, args.gram_norm,
            budget, meta["head_dim"], done=done, average=args.average)


def report(rows: list[dict], cache, args, budget: float, num_layers: int, total: float) -> str:
    meta, best = cache.meta, pick(rows)
    default = next((r for r in rows if r["J"] == 1024 and r["aggregate"] == "max"), rows[0])
    verdict = (f"**Cheapest setting stable to ±10 % in ≥ {MOST:.0%} of layers: J={best['J']}, "
               f"aggregation={best['aggregate']}** ({best['stats']['share_within']:.0%} of layers within ±10 %, "
               f"median dim spread {best['stats']['median_dim_spread']:.3f})." if best else
               f"**No setting gives dims stable to ±10 % in ≥ {MOST:.0%} of layers.**")
    parts = [
        "# Stability of the DoF estimate across J-samples", "",
        f"Cache `{cache.key}` ({meta['num_layers']} layers, {meta['num_heads']} heads, "
        f"{meta['num_kv_heads']} KV heads, d={meta['head_dim']}, {meta['num_seqs']}×{meta['seq_len']} tokens); "
        f"{num_layers} layers, λ={args.lam}, gram_norm={args.gram_norm}, num_tokens={args.num_tokens or 'all'}, "
        f"`dof` policy at budget C={budget:g}. Wall time so far {total / 60:.1f} min "
        "(OMP_NUM_THREADS=1, nice 19 on a CPU shared with other runs; CPU seconds below).", "",
        "Spread = (max − min) / mean over R resamples (different J-sample seeds, same pool); a layer is "
        "within ±10 % when every resample's dim lies within 10 % of its mean. The min–max spread grows "
        "with R, so the column at R=2 (first two resamples of every J) compares J fairly where R differs. "
        "Only the J-sample varies here, not the cached tokens.", "",
        summary_table(rows), "", verdict, "",
        layer_table(default), "",
    ]
    if best is not None and best is not default:
        parts += [layer_table(best), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
