"""Streaming layerwise training throughput vs the teacher's forward pass alone.

A streaming step is one teacher forward without gradients (stopped after the deepest trained
layer) plus, for every layer, the softmax loss of its learned PRF features on that layer's q, k,
its backward and its Adam step. The reference is a plain full teacher forward (no capture) on
the same (B, L) batches of the embedded corpus. Target: streaming ≥ 80 % of forward-only tokens/s
(issue #25). This shared machine's speed drifts by ±20 % between minutes, so the two are measured in
``--rounds`` interleaved rounds (forward, then a streaming run, on the same batches) and the row
reports the median round's ratio with the range.
A second row runs ``train.source=cache`` at equal tokens: write every layer's q/k/v of the same
batches to an activation cache, then train each layer from it for the same number of steps.

    python -m benchmarks.bench_stream [--model embedded:smollm2-135m-instruct] [--batch-size 1]
        [--seq-len 512] [--steps 4] [--rounds 3] [--features 64] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Row, add_common_args, print_rows, set_threads, timeit
from benchmarks.counting import StepCounter, replay
from dofla.cache import build_or_load_cache
from dofla.data import build_source, pack_tokens
from dofla.data.stream import BatchStream
from dofla.feature_maps import build_layer_feature_map
from dofla.models import EMBEDDED, get_adapter, load_teacher
from dofla.train.layerwise import LayerTrainConfig, layer_loss, param_groups, run_layerwise
from dofla.train.stream import train_layers_streaming
from dofla.train.teacher_acts import teacher_heldout, teacher_qk


def corpus_stream(tokenizer, batch_size: int, seq_len: int) -> BatchStream:
    source = build_source("embedded")
    return BatchStream(lambda: source.texts("train"), tokenizer, batch_size, seq_len, source="embedded")


@torch.no_grad()
def forward_seconds(teacher, batches: list[torch.Tensor]) -> float:
    """Wall seconds of plain teacher forwards over ``batches`` (after one warm-up forward)."""
    teacher(input_ids=batches[0], use_cache=False)
    start = time.perf_counter()
    for ids in batches:
        teacher(input_ids=ids, use_cache=False)
    return time.perf_counter() - start


def streaming_run(teacher, tokenizer, args, steps: int):
    """One streaming run of ``steps`` steps over all layers; its StreamResult (its seconds include
    the first step's one-time costs and one final held-out evaluation of 64 tokens per layer)."""
    g = get_adapter(teacher).geometry(teacher.config)
    maps = [build_layer_feature_map("learned_prf", g.num_heads, g.head_dim, args.features, seed=i)
            for i in range(g.num_layers)]
    layers = list(range(g.num_layers))
    held_rows = pack_tokens(build_source("embedded").texts("heldout"), tokenizer, 64, 64)
    heldout = teacher_heldout(teacher, held_rows, layers)
    cfg = LayerTrainConfig(batch_size=args.batch_size, eval_every=10**9, warmup_steps=1)
    batches = corpus_stream(tokenizer, args.batch_size, args.seq_len)
    return train_layers_streaming(teacher, batches, maps, layers, cfg, heldout, steps=steps, progress=False)


def cache_run(teacher, batches: list[torch.Tensor], args) -> tuple[float, float, int]:
    """``train.source=cache`` on the same batches: (seconds to build the cache, seconds to train
    every layer from it for ``len(batches)`` steps of ``args.batch_size`` sequences, cache bytes)."""
    g = get_adapter(teacher).geometry(teacher.config)
    maps = [build_layer_feature_map("learned_prf", g.num_heads, g.head_dim, args.features, seed=i)
            for i in range(g.num_layers)]
    tokens = torch.cat(batches)
    cfg = LayerTrainConfig(batch_size=args.batch_size, steps=len(batches), eval_every=10**9, warmup_steps=1,
                           heldout_fraction=0.0, checkpoint_every=10**9)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cache = build_or_load_cache(teacher, tokens, {"bench": "stream"}, Path(tmp) / "cache",
                                    batch_size=args.batch_size, progress=False)
        built = time.perf_counter()
        run_layerwise(maps, lambda i: cache.layer(i).torch()[:2], list(range(g.num_layers)), cfg, Path(tmp) / "layers")
        return built - start, time.perf_counter() - built, cache.nbytes()


def layer_step_row(teacher, ids: torch.Tensor, args, forward_s: float, teacher_s: float) -> Row:
    """Where a streaming step's layer time goes: one layer's softmax loss, backward and Adam step on the
    teacher's q, k of layer 0, timed, then its ops replayed alone (matmuls, the other ops); the rest of
    its time is Python and autograd bookkeeping between ops. With the teacher part of a step
    (``teacher_s``, the early-exit forward) it gives the streaming ratio this loss allows."""
    g = get_adapter(teacher).geometry(teacher.config)
    q, k, _ = teacher_qk(teacher, get_adapter(teacher).attention_modules(teacher), ids, [0])[0]
    fm = build_layer_feature_map("learned_prf", g.num_heads, g.head_dim, args.features, seed=0)
    cfg = LayerTrainConfig(batch_size=args.batch_size)
    opt = torch.optim.Adam(param_groups(fm, cfg), betas=(0.9, 0.999))

    def step():
        opt.zero_grad(set_to_none=True)
        layer_loss(fm, q, k, cfg).backward()
        opt.step()

    whole = timeit(step, repeats=5)
    with StepCounter(keep=True) as counter:
        step()
    matmuls, others = [op for op in counter.ops if op.flops], [op for op in counter.ops if not op.flops]
    t_mm, t_other = replay(matmuls, 3), replay(others, 3)
    n = g.num_layers
    allowed = max(0.0, forward_s / 0.8 - teacher_s) / n
    return Row(f"one layer's softmax loss + backward + Adam step (B={args.batch_size}, L={ids.shape[1]}, "
               f"M={args.features}), its ops replayed alone", f"{n} of them beside the teacher's early-exit forward "
               f"({teacher_s:.2f} s; the full forward {forward_s:.2f} s)", "explains the streaming ratio",
               f"{whole * 1e3:.1f} ms: matmuls {t_mm * 1e3:.1f} ms ({len(matmuls)} ops), other ops "
               f"{t_other * 1e3:.1f} ms ({len(others)} ops), Python and autograd "
               f"{max(0.0, whole - t_mm - t_other) * 1e3:.1f} ms; {n} layers {n * whole:.2f} s",
               forward_s / (teacher_s + n * whole), None,
               "ratio = the streaming ratio these costs give: full forward / (early-exit forward + the layers' "
               f"steps); 0.80 allows {allowed * 1e3:.1f} ms per layer")


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--model", default=EMBEDDED)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved forward/streaming rounds (median)")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    if args.quick:
        args.seq_len, args.steps = 128, 2
    teacher, tokenizer = load_teacher(args.model)
    stream = corpus_stream(tokenizer, args.batch_size, args.seq_len)
    batches = [stream.next_batch() for _ in range(args.steps)]
    tokens = args.steps * args.batch_size * args.seq_len
    rounds = []  # (forward tok/s, streaming tok/s, teacher share of the streaming step)
    for _ in range(1 if args.quick else args.rounds):
        t_forward = forward_seconds(teacher, batches)
        result = streaming_run(teacher, tokenizer, args, steps=args.steps)
        rounds.append((tokens / t_forward, result.tokens / result.seconds, result.teacher_seconds / result.seconds))
    rounds.sort(key=lambda r: r[1] / r[0])
    ratios = [stream / forward for forward, stream, _ in rounds]
    fwd_rate, stream_rate, teacher_share = rounds[len(rounds) // 2]  # the median round
    ratio = stream_rate / fwd_rate
    layers = len(result.summaries)
    shape = f"B={args.batch_size}, L={args.seq_len}, {args.steps} steps, {layers} layers, M={args.features}"
    per_step = args.batch_size * args.seq_len
    breakdown = layer_step_row(teacher, batches[0], args, per_step / fwd_rate, teacher_share * per_step / stream_rate)
    build_s, train_s, nbytes = cache_run(teacher, batches, args)
    cache_rate = tokens / (build_s + train_s)
    return [Row(f"streaming step throughput ({args.model}, {shape})",
                "teacher forward alone, same batches", "≥ 80 %",
                f"stream {stream_rate:.0f} tok/s vs forward {fwd_rate:.0f} tok/s (median of {len(rounds)} "
                f"interleaved rounds; ratios {ratios[0]:.2f}–{ratios[-1]:.2f})", ratio, ratio >= 0.8,
                f"teacher part of a streaming step {teacher_share:.0%} (early exit skips the LM head); "
                f"each run's seconds include its first step and a final held-out evaluation; {threads} threads"),
            Row(f"train.source=cache at equal tokens ({tokens} tokens)", "streaming, same batches and steps",
                "disk grows with tokens; stream none", f"cache {cache_rate:.0f} tok/s (build {build_s:.1f} s + train "
                f"{train_s:.1f} s, {nbytes / 2**20:.1f} MiB on disk = {nbytes / tokens / 1024:.0f} KiB/token) vs "
                f"stream {stream_rate:.0f} tok/s", cache_rate / stream_rate, True,
                "a cache pays its build once and is reused by every run of a sweep on the same data"),
            breakdown]


if __name__ == "__main__":
    print_rows(main(), title="dofla benchmarks: stream")
