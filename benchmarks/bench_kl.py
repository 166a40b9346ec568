"""The distill stage's speed (``distill=kl``) against its bound, with and without the teacher-logit cache.

    python -m benchmarks.bench_kl [--seq-len 2048] [--rows 1] [--repeats 3] [--topk 64] [--threads N] [--quick]
                                  [--attention hybrid|linear|gated_delta]

The student of the 2,048-token recipe (``docs/results/hybrid_far_context.md``): SmolLM2-135M with
hybrid attention (window 64, 4 sinks) and freshly converted Hedgehog features (M = 64), features and
attention projections trained (``--attention``: the pure additive linear student, or the gated
delta-rule one, its gates training with its features, instead); real text (the embedded source), ``--rows`` sequences of ``--seq-len``
tokens per step. Each round runs, back to back in one process (the machine is shared: ratios within
a round are what compare):

- the teacher's forward and the student's forward (no gradient) over one step's tokens;
- one stage step (``train_kl``: the teacher's targets, the student's forward and backward, the KL,
  clipping, AdamW) without the cache, in the ``--topk`` format; with exact targets, the fused KL
  and the plain composed one (``kl_to_teacher``); with an empty cache (the first run: computes and
  stores); with the filled cache (a rerun on the same text: reads).

The bound is the time of one teacher forward and three student forwards (a forward and a backward
costing about two): tokens/s = 1 / (1 / teacher forward tokens/s + 3 / student forward tokens/s).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Row, add_common_args, finish, set_threads
from dofla.cache.teacher_logits import TeacherLogitCache
from dofla.data import build_source, pack_tokens
from dofla.models import EMBEDDED, convert, load_teacher
from dofla.train.distill import DistillSchedule, kl_to_teacher, teacher_targets, train_kl

TRAIN = ["features", "attention"]


class Composed:
    """Exact targets whose KL is the plain composed form (``kl_to_teacher``): the step before fusing."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def prepared(self, temperature: float) -> "Composed":
        return self

    def kl(self, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return kl_to_teacher(student_logits, self.logits, temperature)


class Rows:
    """The same (rows, L) batch for every step (``BatchStream``'s interface)."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.batch_tokens = ids, ids.numel()

    def next_batch(self) -> torch.Tensor:
        return self.ids

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


STUDENTS = {"hybrid": {"attention": "hybrid", "window": 64, "sinks": 4},
            "linear": {"attention": "linear"},
            "gated_delta": {"attention": "gated_delta", "chunk_size": 32}}  # conf/attention/gated_delta.yaml's chunk


def setup(seq_len: int, rows: int, attention: str = "hybrid"):
    teacher, tokenizer = load_teacher(EMBEDDED)
    student = convert(copy.deepcopy(teacher), feature_map="hedgehog", dims=[64] * 30, **STUDENTS[attention])
    ids = pack_tokens(build_source("embedded").texts("train"), tokenizer, seq_len, rows * seq_len)
    return teacher, student, ids


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(teacher, student, ids, s: DistillSchedule, root: Path) -> dict[str, float]:
    """Seconds of each measurement of one round (module docstring), back to back."""
    def stage(targets_of=None, schedule=s):
        return lambda: train_kl(student, teacher, Rows(ids), TRAIN, schedule, progress=False, targets_of=targets_of)

    cache = TeacherLogitCache(root, {"bench": time.time()}, 2**40)  # a new, empty namespace
    from_cache = lambda rows: cache.targets(rows, lambda m: teacher_targets(teacher, m, s))  # noqa: E731

    def composed(rows):
        with torch.no_grad():
            return Composed(teacher(input_ids=rows, use_cache=False).logits)

    with torch.no_grad():
        times = {"teacher": timed(lambda: teacher(input_ids=ids, use_cache=False)),
                 "student": timed(lambda: student(input_ids=ids, use_cache=False))}
    times["plain"] = timed(stage())
    exact = dataclasses.replace(s, teacher_topk=0)
    times["fused"] = times["plain"] if not s.teacher_topk else timed(stage(schedule=exact))
    times["composed"] = timed(stage(composed, exact))
    times["first"] = timed(stage(from_cache))
    times["rerun"] = timed(stage(from_cache))
    if (cache.hits, cache.misses) != (len(ids), len(ids)):
        raise RuntimeError(f"the cache read {cache.hits} rows and computed {cache.misses}; the rerun should read all")
    return times


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every measurement (medians)")
    parser.add_argument("--topk", type=int, default=64, help="the cache's format (0: exact logits)")
    parser.add_argument("--attention", choices=sorted(STUDENTS), default="hybrid", help="the student's attention")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.seq_len, args.rows, args.repeats = 256, 1, 1
    teacher, student, ids = setup(args.seq_len, args.rows, args.attention)
    s = DistillSchedule(steps=1, micro_batch_size=args.rows, lr=1e-4, feature_lr=1e-3, warmup_steps=0,
                        teacher_topk=args.topk)
    with tempfile.TemporaryDirectory() as root:
        # warm-up at full size: the first step grows malloc's heap to the step's peak (page faults) and makes
        # AdamW's state, which every later step of a stage reuses
        one_round(teacher, student, ids, s, Path(root))
        rounds = [one_round(teacher, student, ids, s, Path(root)) for _ in range(args.repeats)]
    return rows_of(rounds, ids.numel(), args)


def rows_of(rounds: list[dict[str, float]], tokens: int, args) -> list[Row]:
    median = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    ratio = lambda a, b: statistics.median(r[a] / r[b] for r in rounds)  # noqa: E731
    rate = {k: tokens / median(k) for k in rounds[0]}
    bound = 1 / (1 / rate["teacher"] + 3 / rate["student"])
    of_bound = statistics.median(tokens / r["plain"] * (r["teacher"] + 3 * r["student"]) / tokens for r in rounds)
    shape = f"{args.rows}×{args.seq_len}"
    fmt = f"top-{args.topk}" if args.topk else "exact logits"
    note = (f"{len(rounds)} repeat(s), ratios within a repeat; teacher fwd {rate['teacher']:.0f} tok/s, student fwd "
            f"{rate['student']:.0f} tok/s; a cached step is {median('rerun') / median('student'):.2f}× a student fwd")
    return [
        Row(f"distill (KL) stage tokens/s, {shape} tokens, {args.attention} Hedgehog student, {fmt} targets",
            "bound 1/(1/teacher fwd + 3/student fwd), measured in the same repeat", "≥ 80 %",
            f"{rate['plain']:.1f} vs bound {bound:.1f} tok/s", of_bound, of_bound >= 0.8, note),
        Row(f"distill stage rerun on the same text, teacher-logit cache ({fmt})", "the stage without the cache",
            "≥ 1.3×", f"{median('rerun'):.1f} vs {median('plain'):.1f} s per step", ratio("plain", "rerun"),
            ratio("plain", "rerun") >= 1.3, "the rerun skips the teacher's forward"),
        Row(f"distill stage first run, teacher-logit cache computed and stored ({fmt})", "the stage without the cache",
            "≥ 0.97× (a few % at most)", f"{median('first'):.1f} vs {median('plain'):.1f} s per step",
            ratio("plain", "first"), ratio("plain", "first") >= 0.97),
        Row(f"distill stage step, fused exact KL ({shape})", "the composed kl_to_teacher (log-softmaxes, autograd)",
            "≥ 1× (no slower)", f"{median('fused'):.1f} vs {median('composed'):.1f} s per step",
            ratio("composed", "fused"), ratio("composed", "fused") >= 1.0, "exact targets in both, no cache"),
    ]


if __name__ == "__main__":
    finish("kl", main())
