"""One attention layer at long context: linear (chunked) vs SDPA softmax; kernel FLOP rate.

    python -m benchmarks.bench_attention [--seq-len 16384]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from benchmarks.common import Row, matmul_gflops, peak_rss_during, print_rows, run_isolated, save_rows, timeit
from dofla.attention import linear_attention_chunked
from dofla.feature_maps import build_feature_map

HEADS, D = 9, 64


def inputs(t: int, m: int = 64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, t, D, generator=g) for _ in range(3))
    return q * 1.5, k * 1.5, v, build_feature_map("learned_prf", HEADS, D, m).requires_grad_(False)


def linear_layer(q, k, v, fm, chunk: int = 64):
    with torch.no_grad():
        return linear_attention_chunked(fm.log_features(q), fm.log_features(k), v, chunk_size=chunk)[0]


def sdpa_layer(q, k, v):
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def chunked_flops(t: int, m: int, dv: int, chunk: int) -> float:
    """Multiply-adds ×2 of the chunked algorithm (feature maps included) per head."""
    per_chunk = 2 * chunk * chunk * m + 2 * chunk * chunk * dv + 4 * chunk * m * dv + 4 * chunk * m
    features = 2 * 2 * t * m * D
    return HEADS * (math.ceil(t / chunk) * per_chunk + features)


def one_memory_point(kind: str, t: int) -> dict:
    q, k, v, fm = inputs(t)
    run = (lambda: linear_layer(q, k, v, fm)) if kind == "linear" else (lambda: sdpa_layer(q, k, v))
    return {"peak_mib": peak_rss_during(run)}


def main(seq_len: int = 16384, repeats: int = 3) -> list[Row]:
    q, k, v, fm = inputs(seq_len)
    t_sdpa = timeit(lambda: sdpa_layer(q, k, v), repeats=repeats)
    sweep = {c: timeit(lambda c=c: linear_layer(q, k, v, fm, c), repeats=repeats) for c in (16, 32, 64, 128, 256)}
    best = min(sweep, key=sweep.get)
    t_lin = sweep[64]
    gflops = matmul_gflops()
    kernel = chunked_flops(seq_len, 64, D, 64) / t_lin / 1e9
    mem = {t: (run_isolated("bench_attention", "--memory", "linear", str(t))["peak_mib"],
               run_isolated("bench_attention", "--memory", "sdpa", str(t))["peak_mib"])
           for t in (seq_len // 4, seq_len // 2, seq_len)}
    mem_txt = ", ".join(f"T={t}: {a:.0f}/{b:.0f} MiB" for t, (a, b) in mem.items())
    rows = [
        Row(f"1-layer prefill T={seq_len}, M=d=64, 9 heads", "SDPA causal (same run)", "≥ 8×",
            f"linear {t_lin:.3f} s vs SDPA {t_sdpa:.3f} s", t_sdpa / t_lin, t_sdpa / t_lin >= 8),
        Row("peak memory vs T (linear/SDPA)", "linear growth", "linear in T", mem_txt, None, None),
        Row(f"chunked kernel throughput T={seq_len}", f"fp32 matmul {gflops:.0f} GFLOP/s", "≥ 50%",
            f"{kernel:.0f} GFLOP/s (chunk 64)", kernel / gflops, kernel / gflops >= 0.5),
        Row("chunk size sweep", "chunk 64 (default)", "fastest",
            ", ".join(f"{c}: {s:.3f}s" for c, s in sweep.items()), sweep[64] / sweep[best], None,
            f"best {best}"),
    ]
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", nargs=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(one_memory_point(args.memory[0], int(args.memory[1]))))
    else:
        rows = main(args.seq_len, args.repeats)
        save_rows("attention", rows)
        print_rows(rows)
