"""A layer whose KV heads take different forms, prefilled at long context, against the same layer with every
head in each of those forms: the mixed layer makes one kernel call per distinct head plan, so it should take
no longer than its slowest form over every head (target ≤ 1.25×), never the sum of one call per head.

The layer: 8 query heads, 4 KV heads, head size 64; head 0 exact, head 1 a window of 256 with 4 sinks,
head 2 a window of 64 with a delta state of M = 128, head 3 a pure delta state of M = 64.

    python -m benchmarks.bench_mixed_heads [--seq-len 16384] [--repeats 3] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.common import Row, add_common_args, finish, set_threads, timeit
from dofla.models import ConversionSpec
from dofla.models.layers import _layer_attention
from dofla.models.mixed_attention import MixedAttention
from dofla.models.plan import ALL, HeadPlan

HEADS, KV_HEADS, D = 8, 4, 64
MIXED = (HeadPlan(window=ALL), HeadPlan(window=256, sinks=4), HeadPlan(window=64, state="delta", M=128),
         HeadPlan(state="delta", M=64))
GEOMETRY = SimpleNamespace(num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, layer_windows=None,
                           softcap=None)


def layer(heads: tuple[HeadPlan, ...], chunk: int):
    """The layer the plan ``heads`` builds (hedgehog features; delta parts with their gates)."""
    spec = ConversionSpec([D], feature_map="hedgehog", chunk_size=chunk)
    built = _layer_attention(spec, GEOMETRY, 0, heads).requires_grad_(False)
    for part in built.parts if isinstance(built, MixedAttention) else [built]:  # an exact layer by the fused kernel, as the model's SDPA runs it
        part.own_kv = True
    return built


def inputs(t: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, t, D, generator=g)
    k, v = (torch.randn(1, KV_HEADS, t, D, generator=g) for _ in range(2))
    return q, k, v


def cpu_seconds(fn, repeats: int) -> float:
    """Median CPU seconds of ``fn()`` after one warm-up call: on a machine shared with other jobs the wall
    time of a one-thread call counts their time too, its CPU time only its own work."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def rows(t: int, repeats: int, threads: int, chunk: int) -> list[Row]:
    q, k, v = inputs(t)
    mixed_layer, uniform_layers = layer(MIXED, chunk), {h: layer((h,) * KV_HEADS, chunk) for h in MIXED}
    clock = cpu_seconds if threads == 1 else lambda fn, repeats: timeit(fn, repeats=repeats)
    with torch.no_grad():
        mixed = clock(lambda: mixed_layer(q, k, v), repeats)
        uniform = {f"{h.attention_form.name} (window {h.window}, M {h.M})": clock(lambda h=h: uniform_layers[h](q, k, v),
                                                                        repeats) for h in MIXED}
    slowest = max(uniform, key=uniform.get)
    ratio = mixed / uniform[slowest]
    cells = ", ".join(f"{name}: {s * 1e3:.0f} ms" for name, s in uniform.items())
    unit = "CPU time, 1 thread" if threads == 1 else f"wall time, {threads} threads"
    return [Row(f"mixed-head layer prefill T={t} (exact, window 256 + 4 sinks, window 64 + delta M 128, delta M 64)",
                f"every head {slowest}", "≤ 1.25×", f"mixed {mixed * 1e3:.0f} ms vs {uniform[slowest] * 1e3:.0f} ms",
                ratio, ratio <= 1.25, f"{unit}, chunk {chunk}; every form over all heads: {cells}")]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    if args.quick:
        args.seq_len, args.repeats = 2048, 1
    return finish("mixed_heads", rows(args.seq_len, args.repeats, threads, args.chunk))


if __name__ == "__main__":
    main()
