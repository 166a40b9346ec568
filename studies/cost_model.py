"""What the paper's cells cost on one GPU: FLOPs by dtype, memory traffic, peak memory, hours.

For each paper cell (GPT-2: L = 1024, C = 64, batch 128; Pythia-1B: L = 2048, C = 128, batch 64),
loss (softmax, l2, direct) and ``precision`` (fp32, tf32, bf16), the pipeline's own training step
(:func:`dofla.train.capacity.stream_step` / ``direct_step``: the code the run executes, under its
precision: the teacher's bfloat16 copy and autocast for bf16, float64 for l2) runs once on this CPU
on 1- and 2-layer cuts of the teacher (random weights, one sequence) under :class:`StepCounter`:
every matmul-like op's FLOPs (``torch.utils.flop_counter``'s formulas) by the dtype it ran in, and
the bytes every op writes. A stack of identical layers is affine in depth, so the whole model's
counts per token follow. Then, per GPU:

- **predicted time** = Σ matmul FLOPs / (peak for its dtype × MFU) + the bytes every other op writes,
  written once and read once at the memory bandwidth (eager elementwise kernels are memory-bound);
- **floor** = Σ over ops of max(FLOPs / peak, 2 × bytes written / bandwidth): no op faster than its traffic;
- **memory**: the memory preflight's trace at this precision (``dofla.train.capacity``), at the whole
  batch and at the micro-batch ``train.micro_batch_size=auto`` picks on the GPU.

With ``--sweeps`` it also counts the evaluation protocol's task fine-tunes (teacher and student) and
totals each paper sweep: every cell's distillation and student fine-tunes, the teacher's grid once
(:mod:`studies.cost_sweep`).

    python -m studies.cost_model [--teachers gpt2,pythia-1b] [--losses softmax,l2,direct]
                                 [--precisions fp32,tf32,bf16] [--tokens 362e6] [--sweeps] [--out PATH]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from dofla.feature_maps import build_layer_feature_map
from dofla.train import LayerTrainConfig, capacity, configure_matmul, teacher_dtype
from studies.cost_ops import GPUS, CellCost, Gpu, Seconds, counted, counted_cuts, fmt_time, seconds, student_of
from studies.paper_memory import TEACHERS, Teacher, on_meta

PAPER_TOKENS = 362e6  # 10 % of English Wikipedia, one epoch (the paper's runs)
GIB = 2**30


def steps_of(t: Teacher, loss: str, precision: str):
    """The cell's training step builder (``step(depth, micro)``), its teacher (meta weights), feature
    maps, train config and the features' bytes."""
    teacher = on_meta(t.config())
    layers, heads = teacher.config.num_hidden_layers, teacher.config.num_attention_heads
    head_dim = teacher.config.hidden_size // heads
    maps = [build_layer_feature_map("learned_prf", heads, head_dim, t.budget, seed=i) for i in range(layers)]
    cfg = LayerTrainConfig(loss="softmax" if loss == "direct" else loss, batch_size=t.batch, precision=precision)
    features = sum(capacity.module_bytes(m) for m in maps)
    if loss == "direct":
        step = capacity.direct_step(student_of(t), teacher, cfg, t.seq_len, steps=1)
    else:
        dtype = getattr(torch, teacher_dtype(precision, "float32"))
        step = capacity.stream_step(teacher, maps, list(range(layers)), cfg, t.seq_len, dtype, steps=1)
    return step, teacher, maps, cfg, features


def cell_cost(t: Teacher, loss: str, precision: str, memory: bool = True) -> CellCost:
    """Count the cell's step on 1- and 2-layer cuts (one sequence) and extrapolate to the whole model."""
    configure_matmul(precision)
    started = time.perf_counter()
    step, teacher, maps, cfg, features = steps_of(t, loss, precision)
    depth = teacher.config.num_hidden_layers
    ops = counted_cuts(step, (t.name, loss, precision))
    per_token = 1 / t.seq_len
    kinds = {op.kind for n in ops for op in ops[n] if op.flops}
    flops = {kind: per_token * capacity.in_depth(*(sum(op.flops for op in ops[n] if op.kind == kind) for n in (1, 2)),
                                                 depth) for kind in sorted(kinds)}
    written = per_token * capacity.in_depth(*(sum(op.written for op in ops[n]) for n in (1, 2)), depth)
    per_gpu = {}
    for gpu in GPUS:
        one, two = (seconds(ops[n], gpu, precision) for n in (1, 2))
        per_gpu[gpu.name] = Seconds(*(per_token * capacity.in_depth(getattr(one, f), getattr(two, f), depth)
                                      for f in ("matmul", "traffic", "floor")))
    cost = CellCost(t, loss, precision, flops, written, per_gpu, count_seconds=time.perf_counter() - started)
    if memory:
        cost.peak = memory_peak(t, loss, teacher, maps, cfg, features)
        cost.fits = {gpu.name: capacity.largest_fitting(cost.peak, t.batch, capacity.usable(gpu.memory)) for gpu in GPUS}
    configure_matmul("fp32")
    return cost


def memory_peak(t: Teacher, loss: str, teacher, maps, cfg, features: int) -> capacity.Peak:
    """What the memory preflight predicts for the cell at this precision (its trace, at micro-batch 1)."""
    cfg = replace(cfg, micro_batch_size=1)
    if loss == "direct":
        return capacity.direct_step_peak(student_of(t), teacher, teacher.config.num_hidden_layers, cfg, t.seq_len,
                                         2 * capacity.module_bytes(teacher) + features)
    dtype = getattr(torch, teacher_dtype(cfg.precision, "float32"))
    return capacity.stream_step_peak(teacher, maps, list(range(len(maps))), cfg, t.seq_len,
                                     capacity.copy_bytes(teacher, dtype), dtype)


def fmt_flops(flops: dict) -> str:
    short = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return " + ".join(f"{v / 1e9:.2f} G {short.get(k, k)}" for k, v in flops.items() if v >= 5e6) or "0"


def counts_table(costs: list[CellCost]) -> str:
    lines = ["| teacher | L | C | loss | precision | FLOPs per token (by dtype) | bytes written per token | count time |",
             "|---|---|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.teacher.name} | {c.teacher.seq_len} | {c.teacher.budget} | {c.loss} | {c.precision} "
                     f"| {fmt_flops(c.flops)} | {c.written / 1e6:.1f} MB | {c.count_seconds:.0f} s |")
    return "\n".join(lines)


def hours_table(costs: list[CellCost], tokens: float, mfus: list[float]) -> str:
    head = " | ".join(f"predicted @ {m:.0%} MFU" for m in mfus)
    lines = [f"| teacher | loss | precision | GPU | {head} | of which traffic | floor | peak memory, whole batch "
             "| micro-batch `auto` picks |", "|" + "---|" * (8 + len(mfus))]
    for c in costs:
        for gpu in GPUS:
            s = c.per_gpu[gpu.name]
            times = " | ".join(fmt_time(s.predicted(m) * tokens / 3600) for m in mfus)
            memory = f"{c.peak.at(c.teacher.batch).bytes / GIB:.0f} GiB" if c.peak else "not traced"
            fits = c.fits.get(gpu.name, "–") if c.peak else "–"
            lines.append(f"| {c.teacher.name} | {c.loss} | {c.precision} | {gpu.name} | {times} "
                         f"| {fmt_time(s.traffic * tokens / 3600)} | {fmt_time(s.floor * tokens / 3600)} | {memory} "
                         f"| {'does not fit' if fits is None else fits} |")
    return "\n".join(lines)


def calibration(loss: str = "softmax", t: Teacher | None = None, repeats: int = 3) -> str:
    """The model against this CPU: a 2-layer cut of SmolLM2's streamed step (``t``; L = 512, M = 64,
    one sequence, fp32) timed, against its prediction from this CPU's measured 2048² matmul rate and
    copy bandwidth in place of a GPU's peaks (at 100 %: no MFU)."""
    from benchmarks.common import copy_bandwidth, matmul_gflops, timeit

    t = t or Teacher("smollm2-135m", 512, 64, 4, 4)
    torch.manual_seed(0)
    run = steps_of(t, loss, "fp32")[0](2, 1)
    ops = counted(run)
    with capacity.quiet():
        measured = timeit(run, repeats=repeats, best=True)
    rate, bandwidth = matmul_gflops() * 1e9, copy_bandwidth()
    cpu = Gpu("this CPU", 0, bandwidth, dict.fromkeys(("float64", "float32", "tf32", "bfloat16"), rate))
    s = seconds(ops, cpu, "fp32")
    return (f"| {t.name}, 2 layers, L = {t.seq_len}, M = {t.budget}, {loss}, fp32, {torch.get_num_threads()} threads "
            f"| {rate / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s | {s.matmul * 1e3:.0f} + {s.traffic * 1e3:.0f} = "
            f"{s.predicted(1.0) * 1e3:.0f} ms | {measured * 1e3:.0f} ms | {measured / s.predicted(1.0):.2f} |")


CALIBRATION_HEAD = ("| step | this CPU: 2048² matmul, copy bandwidth | predicted: matmuls + other ops' traffic "
                    "| measured | measured / predicted |\n|---|---|---|---|---|")


def disk_table(teachers: list[Teacher], tokens: float) -> str:
    """What ``train.source=cache`` would write (fp16 q, k, v of every layer for every token) against
    streaming's bounded sample (``data.cache_tokens``, default 8,192)."""
    lines = ["| teacher | bytes per token (fp16 q, k, v, every layer) | `train.source=cache`, all tokens "
             "| `train.source=stream` (8,192 tokens cached) |", "|---|---|---|---|"]
    for t in teachers:
        c = t.config()
        heads = c.num_attention_heads
        per_token = c.num_hidden_layers * (heads + 2 * getattr(c, "num_key_value_heads", heads)) \
            * (c.hidden_size // heads) * 2
        lines.append(f"| {t.name} | {per_token / 1e3:.1f} KB | {per_token * tokens / 1e12:.1f} TB "
                     f"| {per_token * 8192 / 1e9:.2f} GB |")
    return "\n".join(lines)


NOTES = """How to read it:
- One cell = one pass of the paper's tokens (`--tokens`) through the layerwise stage (softmax, l2: the
  streamed step, teacher forward + every layer's loss and update) or `direct` (the student's forward
  and backward). Held-out evaluations, Algorithm 1, the fine-tuning and data loading are not counted.
- The step runs on this CPU. Under bf16 the teacher's forward runs in its bfloat16 copy and the
  matmuls under autocast (CPU's and CUDA's autocast agree on matmuls); the losses upcast every
  matmul's output before their exp / log / sums (`dofla.attention.stable`), so their elementwise work
  and its traffic stay float32 (float64 for `l2`) under every precision, on any device. That is why
  bf16 moves about as many bytes as fp32 and, for Pythia-1B's softmax cell, needs more memory per
  sequence (the bfloat16 copies kept for backward come on top of the float32 terms).
- Peaks (dense, no sparsity), by the dtype an op runs in: H100 SXM fp64 / fp32 67, TF32 494.7,
  bf16 989.4 TFLOP/s, 3.35 TB/s; A100 SXM fp64 / fp32 19.5, TF32 156, bf16 312 TFLOP/s, 2.04 TB/s.
  MFU applies to matmuls only; every other op moves its output through memory once each way at full
  bandwidth. Inputs and weights that stay in cache are not charged; fused kernels (`train.compile`)
  move less than this, so the traffic term is an eager-execution estimate, not a bound on compiled code.
- Peak memory is the preflight's (tensor storage; it keeps 10 % and 1 GiB of the GPU free for the
  CUDA context and fragmentation: 80 GB nominal → 66 GiB usable). No GPU has run any of this: every
  figure here is a prediction."""


def main(argv: list[str] | None = None) -> list[CellCost]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teachers", default="gpt2,pythia-1b")
    parser.add_argument("--losses", default="softmax,l2,direct", help="'' with --sweeps: the fine-tunes only")
    parser.add_argument("--precisions", default="fp32,tf32,bf16")
    parser.add_argument("--tokens", type=float, default=PAPER_TOKENS, help="distillation tokens (default 362e6)")
    parser.add_argument("--mfu", type=float, nargs="+", default=[0.4, 0.25], help="matmul FLOP utilisations")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory traces (minutes per cell)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables as markdown here")
    parser.add_argument("--calibrate", action="store_true", help="only the check against this CPU (a minute)")
    parser.add_argument("--sweeps", action="store_true",
                        help="also count the task fine-tunes of the evaluation protocol and total each sweep")
    args = parser.parse_args(argv)
    if args.calibrate:
        text = "\n".join([CALIBRATION_HEAD] + [calibration(loss) for loss in ("softmax", "l2")])
        print(text)
        if args.out is not None:
            args.out.write_text("# Cost model against this CPU\n\n"
                                f"`python -m studies.cost_model --calibrate --out {args.out}`\n\n{text}\n")
        return []
    chosen = [t for t in TEACHERS if t.name in args.teachers.split(",")]
    losses, precisions = [x for x in args.losses.split(",") if x], args.precisions.split(",")
    if not chosen or not set(losses) <= {"softmax", "l2", "direct"} or not set(precisions) <= {"fp32", "tf32", "bf16"} \
            or args.tokens <= 0 or not all(0 < m <= 1 for m in args.mfu):
        parser.error("--teachers from gpt2,pythia-1b; --losses from softmax,l2,direct; --precisions from "
                     "fp32,tf32,bf16; --tokens positive; every --mfu in (0, 1]")
    costs = []
    traced: dict = {}
    for t in chosen:
        for loss in losses:
            for precision in precisions:
                # tf32 changes no tensor and no dtype: its memory is fp32's
                twin = traced.get((t.name, loss, "fp32")) if precision == "tf32" else None
                cost = cell_cost(t, loss, precision, memory=not args.no_memory and twin is None)
                if twin is not None:
                    cost.peak, cost.fits = twin.peak, twin.fits
                traced[t.name, loss, precision] = cost
                costs.append(cost)
                print(f"{t.name} {loss} {precision}: {fmt_flops(cost.flops)} FLOPs/token, "
                      f"{cost.written / 1e6:.1f} MB/token ({cost.count_seconds:.0f} s)", flush=True)
    report = (f"## Per token (whole model, counted)\n\n{counts_table(costs)}\n\n"
              f"## One pass of {args.tokens / 1e6:.0f}M tokens on one GPU\n\n"
              f"{hours_table(costs, args.tokens, args.mfu)}\n\n{NOTES}\n\n"
              f"## Disk: caching every token's activations against streaming\n\n{disk_table(chosen, args.tokens)}\n")
    if args.sweeps:
        report += sweeps_report(chosen, precisions, costs, args)
    print(report)
    if args.out is not None:
        args.out.write_text("# Cost model: the paper's cells on one GPU\n\n"
                            f"`python -m studies.cost_model --out {args.out}`\n\n" + report)
    return costs


def sweeps_report(chosen: list[Teacher], precisions: list[str], costs: list[CellCost], args) -> str:
    """The task fine-tunes' counts and hours, and each sweep's total (:mod:`studies.cost_sweep`)."""
    from studies.cost_sweep import EVAL_TOKENS, eval_costs, sweep_table

    evals = []
    for t in chosen:
        for precision in precisions:
            evals += eval_costs(t, precision, memory=not args.no_memory)
            print(f"{t.name} task fine-tunes {precision}: counted", flush=True)
    return (f"\n## The evaluation protocol: one model's task fine-tunes ({EVAL_TOKENS / 1e6:.0f}M tokens, a bound)\n\n"
            f"{counts_table(evals)}\n\n{hours_table(evals, EVAL_TOKENS, args.mfu)}\n\n"
            f"## Each paper sweep on one GPU\n\n" + "\n\n".join(sweep_table(costs + evals, m) for m in args.mfu) + "\n")


if __name__ == "__main__":
    main()
