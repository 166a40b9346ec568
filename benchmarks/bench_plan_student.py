"""The allocated student (a plan per KV head, ``allocation=budget``): its KL stage's speed beside the uniform
delta hybrid's, and its decoding against context.

    python -m benchmarks.bench_plan_student [--allocation PATH] [--seq-len 2048] [--repeats 2]
                                            [--context 16384] [--short 1024] [--steps 16] [--threads N] [--quick]

The plan is a committed run record's (default: the allocated student at a tenth of the teacher's KV cache
at 8,192 tokens, data order 0), built on the embedded SmolLM2 with fresh Hedgehog features as
``experiment=budget_tenth`` builds it (chunk 128). Rows:

- KL stage tokens/s: one ``train_kl`` step (features and attention trained, exact targets, as the preset's
  KL stage) on ``--seq-len`` tokens of real text, the plan student and the delta hybrid preset
  (``hybrid_delta``: every head a 64-token window with 4 sinks and a gated-delta state of M = 64, chunk 32)
  in turn, round by round after one warm-up step each. Target: ≥ 100 tokens/s for the plan student.
- Decoding at ``--short`` and ``--context`` tokens (greedy steps interleaved round by round): the plan's
  non-exact heads alone (its exact heads given the allocation's baseline option) must be flat in time
  (≤ 1.2×) and in bytes; the plan student grows by its exact heads' KV cache, and what it grows by, like what
  it holds, must be what the plan predicts (``StudentPlan.state_bytes``, which the allocator spends) to the byte.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

from benchmarks.bench_kl import TRAIN, Rows, timed
from benchmarks.bench_model import decode_rounds, decode_start, step_ratio
from benchmarks.common import ROOT, Row, add_common_args, finish, set_threads
from dofla.data import build_source, pack_tokens
from dofla.models import EMBEDDED, convert, load_teacher
from dofla.models.plan import HeadPlan, StudentPlan
from dofla.train.distill import DistillSchedule, train_kl

ALLOCATION = ROOT / "docs" / "results" / "runs" / "budget" / "share0.1_s0" / "allocation.json"


def plans(allocation: dict) -> tuple[StudentPlan, StudentPlan]:
    """The allocated plan, and the same plan with every exact head at the allocation's baseline option."""
    plan = StudentPlan.from_list(allocation["plan"])
    base = HeadPlan(**next(h["plan"] for h in allocation["heads"] if h["option"] == allocation["baseline"]))
    return plan, StudentPlan([tuple(base if h.exact else h for h in layer) for layer in plan.layers])


def kl_rounds(teacher, students: dict, ids, repeats: int) -> dict[str, list[float]]:
    """Seconds of one KL step of each student, in turn, ``repeats`` rounds after one warm-up round."""
    s = DistillSchedule(steps=1, micro_batch_size=ids.shape[0], lr=1e-4, feature_lr=1e-3, warmup_steps=0,
                        teacher_topk=0)
    times = {name: [] for name in students}
    for round_ in range(repeats + 1):
        for name, student in students.items():
            spent = timed(lambda: train_kl(student, teacher, Rows(ids), TRAIN, s, progress=False))
            if round_:
                times[name].append(spent)
    return times


def kl_rows(teacher, plan: StudentPlan, ids, repeats: int, summary: str) -> list[Row]:
    layers = teacher.config.num_hidden_layers
    students = {"plan": convert(copy.deepcopy(teacher), feature_map="hedgehog", plan=plan),
                "hybrid_delta": convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[64] * layers,
                                        attention="gated_delta", window=64, sinks=4, chunk_size=32)}
    times = kl_rounds(teacher, students, ids, repeats)
    rate = {name: ids.numel() / statistics.median(t) for name, t in times.items()}
    ratios = sorted(b / a for a, b in zip(times["plan"], times["hybrid_delta"]))
    return [Row(f"distill (KL) stage tokens/s, {ids.shape[0]}×{ids.shape[1]} tokens, the allocated student ({summary})",
                "delta hybrid (hybrid_delta), steps interleaved", "≥ 100 tok/s",
                f"{rate['plan']:.1f} vs {rate['hybrid_delta']:.1f} tok/s", rate["plan"] / rate["hybrid_delta"],
                rate["plan"] >= 100, f"median of {repeats} round(s) after a warm-up; per-round ratios "
                f"{ratios[0]:.2f}–{ratios[-1]:.2f}; exact targets")]


def decode_rows(teacher, plan: StudentPlan, windows: StudentPlan, t: int, short: int, steps: int,
                summary: str) -> list[Row]:
    g = teacher.config
    group, head_dim = g.num_attention_heads // g.num_key_value_heads, g.hidden_size // g.num_attention_heads
    runs = {}
    for name, p in (("plan", plan), ("windows", windows)):
        model = convert(copy.deepcopy(teacher), feature_map="hedgehog", plan=p).eval()
        runs[(name, short)], runs[(name, t)] = decode_start(model, short), decode_start(model, t)
    decode_rounds(runs, steps)
    # each run's cache holds its context, the warm-up step and the timed steps (decode_start, decode_rounds)
    held = {n: n + 1 + steps for n in (short, t)}
    predicted = {(name, n): p.state_bytes(group, head_dim, held[n]) for name, p in (("plan", plan),
                                                                                      ("windows", windows))
                 for n in (short, t)}
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    ms = lambda run: f"{run['per_token'] * 1e3:.1f} ms"  # noqa: E731
    rows = []
    for name, what, target in (("windows", "its non-exact heads alone (exact heads at the baseline option)",
                                "flat in context (≤ 1.2×)"),
                               ("plan", f"the allocated student ({summary})", "report; bytes as planned")):
        lo, hi = runs[(name, short)], runs[(name, t)]
        growth, spread = step_ratio(hi, lo)
        as_planned = all(runs[(name, n)]["bytes"] == predicted[(name, n)] for n in (short, t))
        ok = as_planned and (growth <= 1.2 and lo["bytes"] == hi["bytes"] if name == "windows" else True)
        rows.append(Row(f"{what}: decode per token and state, context {short} → {t}", "itself at the short context",
                        target, f"{ms(lo)} → {ms(hi)}; {mib(lo['bytes'])} → {mib(hi['bytes'])} (planned "
                        f"{mib(predicted[(name, short)])} → {mib(predicted[(name, t)])})", growth, ok,
                        f"ratio = per-token time at {t} / at {short}, median of {steps} interleaved rounds "
                        f"(ratios {spread}); bytes {'equal to' if as_planned else 'NOT'} the plan's to the byte"))
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--allocation", default=str(ALLOCATION), help="a run's allocation.json (allocation=budget)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens of one KL step")
    parser.add_argument("--repeats", type=int, default=2, help="timed KL rounds (after one warm-up round)")
    parser.add_argument("--context", type=int, default=16384, help="the long decode context")
    parser.add_argument("--short", type=int, default=1024, help="the short decode context")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--skip", default="", help="comma list of: kl,decode")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.seq_len, args.repeats, args.context, args.short, args.steps = 256, 1, 1024, 256, 4
    allocation = json.loads(Path(args.allocation).read_text())
    plan, windows = plans(allocation)
    exact = sum(h.exact for layer in plan.layers for h in layer)
    summary = f"{allocation['budget']['mib']:.1f} MiB at {allocation['budget']['context']:,} tokens, {exact} exact KV heads"
    teacher, tokenizer = load_teacher(EMBEDDED)
    teacher.eval()
    rows = []
    if "kl" not in args.skip:
        ids = pack_tokens(build_source("embedded").texts("train"), tokenizer, args.seq_len, args.seq_len)
        rows += kl_rows(teacher, plan, ids, args.repeats, summary)
    if "decode" not in args.skip:
        rows += decode_rows(teacher, plan, windows, args.context, args.short, args.steps, summary)
    return rows


if __name__ == "__main__":
    finish("plan_student", main())
