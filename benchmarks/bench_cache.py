"""Activation cache build vs a plain teacher forward over the same tokens; disk = predicted size.

    python -m benchmarks.bench_cache [--quick] [--threads N]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks.common import Row, add_common_args, finish, set_threads, timeit
from dofla.cache import build_or_load_cache, predict_cache_bytes
from dofla.models import EMBEDDED, get_adapter, load_teacher


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.seqs, args.seq_len = 2, 128
    teacher, _ = load_teacher(EMBEDDED)
    tokens = torch.randint(0, 1000, (args.seqs, args.seq_len), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def plain():
        for rows in tokens.split(4):
            teacher(input_ids=rows, use_cache=False)

    t_plain = timeit(plain, repeats=1)
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        cache = build_or_load_cache(teacher, tokens, {"bench": time.time()}, root, batch_size=4, progress=False)
        t_cache = time.perf_counter() - start
        data = sum(p.stat().st_size - 128 for p in cache.path.glob("*.npy"))  # minus the .npy header
    predicted = predict_cache_bytes(get_adapter(teacher).geometry(teacher.config), args.seqs, args.seq_len)
    ratio = t_cache / t_plain
    return [Row(f"activation cache build ({args.seqs}×{args.seq_len} tokens, SmolLM2-135M)",
                "plain teacher forward, same tokens", "≤ 1.3×; disk = predicted",
                f"{t_cache:.1f} s vs {t_plain:.1f} s; disk {data / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB",
                ratio, ratio <= 1.3 and data == predicted, "fp16 q, k of every layer")]


if __name__ == "__main__":
    finish("cache", main())
