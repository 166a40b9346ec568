"""One attention layer at long context: linear (chunked) vs SDPA softmax, peak memory vs T,
the chunked kernel's FLOP rate, a chunk-size sweep and the cost of the causal stabiliser's
guarded path (a far-future outlier key in every chunk).

    python -m benchmarks.bench_attention [--seq-len 16384] [--repeats 5] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import (Row, add_common_args, finish, interleaved, matmul_gflops, peak_delta_mib,
                               run_isolated, set_threads, timeit)
from benchmarks.counting import StepCounter, replay
from dofla.attention import linear_attention_chunked
from dofla.attention.groups import GROUP_TOKENS
from dofla.config import AttentionConfig
from dofla.feature_maps import build_feature_map

HEADS, D, M = 9, 64, 64
DEFAULT_CHUNK = AttentionConfig.chunk_size  # the library default


def inputs(t: int, seed: int = 0):
    """q, k, v (1, 9, T, 64) at realistic PRF norms (|x|²/sqrt(d) ≈ 18) and a learned_prf map."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, t, D, generator=g) for _ in range(3))
    fm = build_feature_map("learned_prf", HEADS, D, M).requires_grad_(False)
    return q * 1.5, k * 1.5, v, fm


@torch.no_grad()
def linear_layer(q, k, v, fm, chunk: int = DEFAULT_CHUNK):
    """What the student runs per layer in prefill: both feature maps, then the chunked kernel."""
    return linear_attention_chunked(fm.log_features(q), fm.log_features(k), v, chunk_size=chunk)[0]


@torch.no_grad()
def sdpa_layer(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def chunked_flops(t: int, chunk: int, m: int = M, dv: int = D) -> float:
    """FLOPs (2 per multiply-add) of linear_attention_chunked, all heads, feature maps excluded.

    Per chunk of C tokens and head: φq·φkᵀ 2C²M, scores·v 2C²dv (full C×C: the kernel computes the
    whole block then masks it), φq·kv 2CM·dv, φq·k_sum 2CM, row sums C², φkᵀ·v 2CM·dv, Σφk CM,
    state rescale M·dv + M; plus the exps of φq, φk (counted 1 each: 2CM).
    """
    n, c = math.ceil(t / chunk), chunk
    per_chunk = (2 * c * c * m + 2 * c * c * dv + 4 * c * m * dv + 2 * c * m + c * c + c * m
                 + m * dv + m + 2 * c * m)
    return HEADS * n * per_chunk


def with_outliers(log_k: torch.Tensor, chunk: int, gap: float = 120.0) -> torch.Tensor:
    """log_k with key feature 0 raised by ``gap`` nats at the middle of every chunk: every earlier
    row of the chunk that leans on feature 0 goes through the exact (log-space) recomputation."""
    out = log_k.clone()
    out[:, :, chunk // 2::chunk, 0] += gap
    return out


def outlier_row(log_q, log_k, v, t: int, reps: int, plain_s: float) -> Row:
    """Kernel time with an outlier in every chunk vs the same inputs without (same run)."""
    spiked = with_outliers(log_k, DEFAULT_CHUNK)
    slow = timeit(lambda: linear_attention_chunked(log_q, spiked, v, chunk_size=DEFAULT_CHUNK), repeats=reps)
    return Row(f"chunked kernel T={t}, a 120-nat outlier key in every chunk (worst case for the stabiliser)",
               f"same inputs without outliers ({plain_s * 1e3:.0f} ms)", "exact; slowdown reported",
               f"{slow * 1e3:.0f} ms", slow / plain_s, None,
               "rows that see the outlier's feature only later are recomputed in log space")


def gated_row(log_q, log_k, v, t: int, reps: int, plain_s: float) -> Row:
    """The gated kernel (a decay per head and token) vs the ungated one on the same inputs."""
    decay = -0.05 * torch.rand(log_k.shape[:3], generator=torch.Generator().manual_seed(1))
    gated = timeit(lambda: linear_attention_chunked(log_q, log_k, v, chunk_size=DEFAULT_CHUNK, log_decay=decay),
                   repeats=reps)
    return Row(f"gated chunked kernel T={t} (attention.gate: a decay per head and token)",
               f"ungated kernel, same inputs ({plain_s * 1e3:.0f} ms)", "report", f"{gated * 1e3:.0f} ms",
               gated / plain_s, None, "ratio = gated / ungated time; two shifts and one cumsum per chunk")


def breakdown_row(log_q, log_k, v, t: int, reps: int, gflops: float) -> Row:
    """Where the kernel's time goes: its matmuls replayed alone, back to back (the rate their shapes
    reach on this CPU: the ceiling of the kernel's rate if every other op and the Python were free),
    then every other op replayed alone; the rest of the kernel's time is the Python between ops. At
    most 4,096 tokens (every chunk does the same work; replaying keeps every op's inputs alive)."""
    t = min(t, 4096)
    log_q, log_k, v = log_q[:, :, :t], log_k[:, :, :t], v[:, :, :t]
    with torch.no_grad():
        whole = timeit(lambda: linear_attention_chunked(log_q, log_k, v, chunk_size=DEFAULT_CHUNK), repeats=reps)
        with StepCounter(keep=True) as counter:
            linear_attention_chunked(log_q, log_k, v, chunk_size=DEFAULT_CHUNK)
    matmuls, others = [op for op in counter.ops if op.flops], [op for op in counter.ops if not op.flops]
    t_mm, t_other = replay(matmuls, reps), replay(others, reps)
    flops = sum(op.flops for op in matmuls)
    ceiling = flops / t_mm / 1e9
    return Row(f"chunked kernel T={t} (chunk {DEFAULT_CHUNK}): its ops replayed alone",
               f"fp32 2048² matmul {gflops:.0f} GFLOP/s; the kernel as called {whole * 1e3:.0f} ms", "explains the ≥ 50% miss",
               f"matmuls {t_mm * 1e3:.0f} ms ({len(matmuls)} ops, {flops / 1e9:.2f} GFLOP: {ceiling:.0f} GFLOP/s); "
               f"other ops {t_other * 1e3:.0f} ms ({len(others)} ops, {sum(op.written for op in others) / 1e6:.0f} MB "
               f"written); {python(whole - t_mm - t_other)}", ceiling / gflops, None,
               "ratio = the kernel's matmuls alone against a 2048² matmul: the most the kernel could reach "
               "if nothing else took time")


def python(rest: float) -> str:
    """The kernel's time beyond its replayed ops: the Python between them (or none: the replay, whose
    ops find colder caches than the kernel's, took longer than the kernel itself)."""
    return f"Python between them {rest * 1e3:.0f} ms" if rest > 0 else \
        f"no time left for Python between them (the replay took {-rest * 1e3:.0f} ms longer than the kernel)"


def prefill_row(t: int, chunk: int, linear: list[float], sdpa: list[float], features: float, threads: int) -> Row:
    """One layer's prefill (features included) against SDPA: the median of the interleaved calls' ratios."""
    ratios = sorted(a / b for a, b in zip(sdpa, linear))
    ratio = statistics.median(ratios)
    default = " (the default)" if chunk == DEFAULT_CHUNK else " (attention.chunk_size)"
    return Row(f"1-layer prefill T={t}, M=d=64, 9 heads, learned_prf features incl., chunk {chunk}{default}",
               "SDPA is_causal (same shapes, calls interleaved)", "≥ 12×",
               f"linear {statistics.median(linear) * 1e3:.0f} ms (features {features * 1e3:.0f} ms) vs SDPA "
               f"{statistics.median(sdpa) * 1e3:.0f} ms", ratio, ratio >= 12,
               f"{threads} threads; median of {len(ratios)} interleaved rounds, ratios {ratios[0]:.1f}–{ratios[-1]:.1f}")


def memory_point(kind: str, t: int) -> dict:
    """Run in a fresh process: peak-RSS growth of one prefill (inputs excluded)."""
    q, k, v, fm = inputs(t)
    run = (lambda: linear_layer(q, k, v, fm)) if kind == "linear" else (lambda: sdpa_layer(q, k, v))
    return {"kind": kind, "T": t, "peak_mib": peak_delta_mib(run)}


def memory_rows(lengths: list[int]) -> list[Row]:
    # malloc as it comes (dofla.runtime off): every large block is mapped when allocated, so the peak is the
    # layer's own, not hidden by memory the inputs' set-up freed and the allocator kept
    plain = {"DOFLA_KEEP_FREED_MEMORY": "0"}
    mem = {t: {kind: run_isolated("bench_attention", "--memory-point", kind, str(t), env=plain)["peak_mib"]
               for kind in ("linear", "sdpa")} for t in lengths}
    txt = ", ".join(f"T={t}: {m['linear']:.0f}/{m['sdpa']:.0f} MiB" for t, m in mem.items())
    lo, hi = lengths[0], lengths[-1]
    growth = {kind: mem[hi][kind] / max(mem[lo][kind], 1e-3) for kind in ("linear", "sdpa")}
    # linear in T: growth over lo->hi at most hi/lo (a constant part makes it smaller), 1.5× slack
    linear_ok = growth["linear"] <= 1.5 * hi / lo
    return [Row("1-layer peak memory vs T (linear/SDPA, fresh process per point)", "linear growth in T",
                f"≤ ~{hi // lo}× from T={lo} to {hi}", txt, growth["linear"], linear_ok,
                f"SDPA grows {growth['sdpa']:.1f}×; ratio = linear's growth")]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", default="16,32,64,128,256")
    parser.add_argument("--mem-lens", default="2048,4096,8192,16384", help="'' skips the memory row")
    parser.add_argument("--memory-point", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    if args.memory_point:
        print(json.dumps(memory_point(args.memory_point[0], int(args.memory_point[1]))))
        return []
    if args.quick:
        args.seq_len, args.repeats, args.mem_lens = 2048, 1, "512,1024,2048"
    t, reps = args.seq_len, args.repeats
    chunks = [int(c) for c in args.chunks.split(",")]
    q, k, v, fm = inputs(t)

    # 1. one layer's prefill, feature maps included, vs SDPA on the same shapes, interleaved call by call
    fast = 64 if 64 in chunks else DEFAULT_CHUNK
    times = interleaved({"sdpa": lambda: sdpa_layer(q, k, v), "linear": lambda: linear_layer(q, k, v, fm),
                         "fast": lambda: linear_layer(q, k, v, fm, fast)}, reps)
    with torch.no_grad():
        log_q, log_k = fm.log_features(q), fm.log_features(k)
        t_feat = timeit(lambda: (fm.log_features(q), fm.log_features(k)), repeats=reps)
    # 2. the chunked kernel alone (precomputed log features), chunk sweep
    sweep = {c: timeit(lambda c=c: linear_attention_chunked(log_q, log_k, v, chunk_size=c), repeats=reps)
             for c in chunks}
    gflops = matmul_gflops()
    best = min(sweep, key=sweep.get)
    base = DEFAULT_CHUNK if DEFAULT_CHUNK in sweep else chunks[0]
    rate = {c: chunked_flops(t, c) / s / 1e9 for c, s in sweep.items()}
    rows = [
        prefill_row(t, DEFAULT_CHUNK, times["linear"], times["sdpa"], t_feat, threads),
        prefill_row(t, fast, times["fast"], times["sdpa"], t_feat, threads),
        Row(f"chunked kernel throughput T={t}, M=d=64 (chunk {base})",
            f"fp32 2048² matmul {gflops:.0f} GFLOP/s", "≥ 50%",
            f"{rate[base]:.1f} GFLOP/s ({chunked_flops(t, base) / 1e9:.2f} GFLOP in {sweep[base] * 1e3:.0f} ms); "
            f"best chunk {best}: {rate[best]:.1f} GFLOP/s", rate[base] / gflops, rate[base] / gflops >= 0.5,
            f"{base}×{base} in-chunk matmuls and their element-wise ops, batched over groups of {GROUP_TOKENS} tokens; "
            "kernel time excludes the feature maps"),
        Row(f"chunk size sweep T={t} (kernel only)", f"chunk {base} (library default)", "default is fastest",
            ", ".join(f"{c}: {s * 1e3:.0f} ms" for c, s in sweep.items()), sweep[base] / sweep[best],
            None, f"best {best}" + ("" if best == base else f", {sweep[base] / sweep[best]:.2f}× vs {base}")),
    ]
    rows.append(outlier_row(log_q, log_k, v, t, reps, sweep[base]))
    rows.append(gated_row(log_q, log_k, v, t, reps, sweep[base]))
    rows.append(breakdown_row(log_q, log_k, v, t, reps, gflops))
    if args.mem_lens:
        rows += memory_rows([int(x) for x in args.mem_lens.split(",")])
    return rows


if __name__ == "__main__":
    rows = main()
    if rows:
        finish("attention", rows)
