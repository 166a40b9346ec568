"""The gated delta rule at long context: chunked prefill against SDPA and against the additive chunked
kernel, a chunk-size sweep, and decode time per token at several context lengths (flat for the delta
state, growing for a softmax KV cache).

    python -m benchmarks.bench_delta [--seq-len 16384] [--repeats 3] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import Row, add_common_args, finish, set_threads, timeit
from dofla.attention import linear_attention_chunked
from dofla.attention.delta import delta_rule_chunked, delta_rule_recurrent, unit_features
from dofla.feature_maps import build_feature_map

HEADS, D, M = 9, 64, 64
CHUNK = 64  # the delta kernel's default chunk


def inputs(t: int, seed: int = 0):
    """q, k, v (1, 9, T, 64), Hedgehog log features of q and k (M = 64), gates log α, β (1, 9, T)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, t, D, generator=g) for _ in range(3))
    fm = build_feature_map("hedgehog", HEADS, D, M).requires_grad_(False)
    with torch.no_grad():
        log_q, log_k = fm.log_features(q), fm.log_features(k)
    log_alpha = -0.01 * torch.rand(1, HEADS, t, generator=g)
    beta = torch.rand(1, HEADS, t, generator=g)
    return q, k, v, log_q, log_k, log_alpha, beta


@torch.no_grad()
def delta_prefill(log_q, log_k, v, log_alpha, beta, chunk: int = CHUNK):
    """The kernel with the normalisation of the features (what a delta layer runs besides its gates)."""
    return delta_rule_chunked(unit_features(log_q), unit_features(log_k), v, log_alpha, beta, chunk)[0]


def prefill_rows(t: int, reps: int, threads: int, chunks: list[int]) -> list[Row]:
    q, k, v, log_q, log_k, log_alpha, beta = inputs(t)
    with torch.no_grad():
        t_sdpa = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=reps)
        t_add = timeit(lambda: linear_attention_chunked(log_q, log_k, v, chunk_size=128), repeats=reps)
    sweep = {c: timeit(lambda c=c: delta_prefill(log_q, log_k, v, log_alpha, beta, c), repeats=reps) for c in chunks}
    t_delta = sweep.get(CHUNK, min(sweep.values()))
    best = min(sweep, key=sweep.get)
    shape = f"T={t}, 9 heads, d=M=64"
    return [
        Row(f"delta prefill {shape} (chunk {CHUNK}, features normalised)", "SDPA is_causal (same run)", "report",
            f"delta {t_delta * 1e3:.0f} ms vs SDPA {t_sdpa * 1e3:.0f} ms", t_sdpa / t_delta, None, f"{threads} threads"),
        Row(f"delta prefill {shape} (chunk {CHUNK})", "additive chunked kernel (linear_attention_chunked, chunk 128)",
            "report", f"delta {t_delta * 1e3:.0f} ms vs additive {t_add * 1e3:.0f} ms", t_add / t_delta, None,
            f"{threads} threads"),
        Row(f"delta chunk sweep {shape}", "", "report",
            ", ".join(f"{c}: {s * 1e3:.0f} ms" for c, s in sweep.items()) + f"; best {best}", None, None),
    ]


@torch.no_grad()
def decode_times(contexts: list[int], steps: int) -> dict[int, tuple[float, float]]:
    """{context: (seconds per token of the delta step, of SDPA with a KV cache of that length)}."""
    out = {}
    for n in contexts:
        q, k, v, log_q, log_k, log_alpha, beta = inputs(n + 1)
        qh, kh = unit_features(log_q), unit_features(log_k)
        _, state = delta_rule_chunked(qh[:, :, :n], kh[:, :, :n], v[:, :, :n], log_alpha[:, :, :n], beta[:, :, :n])
        last = [x[:, :, n:] for x in (qh, kh, v, log_alpha, beta)]
        step = lambda: [delta_rule_recurrent(*last, state=state) for _ in range(steps)]  # noqa: E731
        t_delta = timeit(step, repeats=5, best=True) / steps  # best of 5: a shared machine's noise only adds
        t_sdpa = timeit(lambda: [F.scaled_dot_product_attention(q[:, :, n:], k, v) for _ in range(steps)],
                        repeats=5, best=True) / steps
        out[n] = (t_delta, t_sdpa)
    return out


def decode_rows(contexts: list[int], steps: int) -> list[Row]:
    times = decode_times(contexts, steps)
    first, last = contexts[0], contexts[-1]
    flat = times[last][0] / times[first][0]
    cells = ", ".join(f"{n}: {d * 1e6:.0f} µs (SDPA {s * 1e6:.0f} µs)" for n, (d, s) in times.items())
    return [Row(f"delta decode per token, one layer, contexts {first}..{last}", f"the same step at {first}",
                "≤ 1.5× (flat)", cells, flat, flat <= 1.5, "the state is M×dv per head at any context")]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", default="32,64,128")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--decode-steps", type=int, default=50)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    if args.quick:
        args.seq_len, args.repeats, args.contexts, args.decode_steps = 2048, 1, "256,1024,2048", 10
    rows = prefill_rows(args.seq_len, args.repeats, threads, [int(c) for c in args.chunks.split(",")])
    rows += decode_rows([int(c) for c in args.contexts.split(",")], args.decode_steps)
    return finish("delta", rows)


if __name__ == "__main__":
    main()
