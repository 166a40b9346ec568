"""The whole embedded model: prefill and decode, student vs teacher, and dof vs fix cost.

    python -m benchmarks.bench_model [--seq-len 16384] [--quick]
"""
from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache

from benchmarks.common import Row, print_rows, save_rows, timeit
from dofla.models import EMBEDDED, RecurrentStateCache, convert, load_teacher


def prefill(model, ids) -> None:
    with torch.no_grad():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)


def decode_seconds(model, context: int, steps: int, cache) -> tuple[float, int]:
    """Prefill ``context`` tokens into ``cache`` (not timed), then time ``steps`` single-token steps."""
    import time

    ids = torch.randint(0, 1000, (1, context))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps, cache_bytes(cache)


def cache_bytes(cache) -> int:
    if isinstance(cache, RecurrentStateCache):
        return cache.state_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main(seq_len: int = 16384, steps: int = 16, quick: bool = False) -> list[Row]:
    teacher, _ = load_teacher(EMBEDDED)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[64] * 30)
    ids = torch.randint(0, 1000, (1, seq_len))
    t_teacher = timeit(lambda: prefill(teacher, ids), repeats=1, warmup=0)
    t_student = timeit(lambda: prefill(student, ids), repeats=1, warmup=0)
    short = 1024 if not quick else 256
    d_short, m_short = decode_seconds(student, short, steps, RecurrentStateCache(30))
    d_long, m_long = decode_seconds(student, seq_len, steps, RecurrentStateCache(30))
    t_short, tm_short = decode_seconds(teacher, short, steps, DynamicCache(config=teacher.config))
    t_long, tm_long = decode_seconds(teacher, seq_len, steps, DynamicCache(config=teacher.config))
    rows = [
        Row(f"whole-model prefill T={seq_len}", "teacher with SDPA", "≥ 3×",
            f"student {t_student:.1f} s vs teacher {t_teacher:.1f} s", t_teacher / t_student,
            t_teacher / t_student >= 3),
        Row(f"decode per token, context {seq_len} vs {short}", "itself", "≤ 1.2×",
            f"{d_long * 1e3:.1f} ms vs {d_short * 1e3:.1f} ms", d_long / d_short, d_long / d_short <= 1.2),
        Row(f"decode per token at context {seq_len}", "teacher + KV cache", "≥ 3×",
            f"student {d_long * 1e3:.1f} ms vs teacher {t_long * 1e3:.1f} ms", t_long / d_long, t_long / d_long >= 3),
        Row("decode memory (state vs KV cache)", f"context {short} → {seq_len}", "flat",
            f"student {m_short / 2**20:.2f} → {m_long / 2**20:.2f} MiB; teacher {tm_short / 2**20:.0f} → "
            f"{tm_long / 2**20:.0f} MiB", None, m_short == m_long),
    ]
    rows += cost_of_policies(teacher, min(seq_len, 4096), steps)
    return rows


def cost_of_policies(teacher, seq_len: int, steps: int) -> list[Row]:
    """Prefill/decode time of fix, dof (same mean dim) and dof_clip allocations (the paper's cost)."""
    from dofla.dof import allocate_dims

    profile = [36.5, 7.4, 22.4, 11.5, 10.1, 9.7, 12.8, 15.7, 8.9, 10.8, 7.6, 12.7, 7.0, 13.8, 8.6,
               7.3, 9.8, 6.1, 10.1, 10.4, 8.9, 13.6, 7.4, 8.6, 8.1, 7.3, 10.0, 7.4, 8.0, 9.9]  # dof.json
    ids = torch.randint(0, 1000, (1, seq_len))
    times = {}
    for policy in ("fix", "dof", "dof_clip"):
        dims = allocate_dims(profile, 64, policy, 64)
        student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=dims)
        pre = timeit(lambda: prefill(student, ids), repeats=2)
        dec, _ = decode_seconds(student, 256, steps, RecurrentStateCache(30))
        times[policy] = (pre, dec, sum(dims) / len(dims))
    (pf, df, _), (pd, dd, _), (pc, dc, mc) = times["fix"], times["dof"], times["dof_clip"]
    return [
        Row(f"dof vs fix at equal budget (T={seq_len})", "fix", "equal within noise",
            f"prefill {pd:.2f}/{pf:.2f} s, decode {dd * 1e3:.1f}/{df * 1e3:.1f} ms", pd / pf,
            abs(pd / pf - 1) < 0.15),
        Row(f"dof_clip (mean dim {mc:.1f}) vs fix", "fix", "cheaper",
            f"prefill {pc:.2f}/{pf:.2f} s, decode {dc * 1e3:.1f}/{df * 1e3:.1f} ms", pc / pf, pc < pf),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = main(1024 if args.quick else args.seq_len, 4 if args.quick else args.steps, args.quick)
    save_rows("model", rows)
    print_rows(rows)
