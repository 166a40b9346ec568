"""The whole embedded model (SmolLM2-135M, 30 layers): prefill and decode, student vs teacher,
and the cost of the fix / dof / dof_clip / dof_head dimension allocations.

    python -m benchmarks.bench_model [--seq-len 16384] [--short 1024] [--steps 16] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.common import Row, add_common_args, finish, paired_ratio, set_threads, timeit
from dofla.config import AllocationConfig, AttentionConfig
from dofla.dof import allocate_dims, allocate_head_dims
from dofla.feature_maps import mean_dim
from dofla.models import EMBEDDED, RecurrentStateCache, convert, load_teacher

# The dof.json of the default `dofla` run on the embedded model (per layer and per head): with a
# mean budget of 64, ``dof`` gives dims 36..213 and ``dof_clip`` caps them at the head size.
EMBEDDED_DOF_JSON = Path(__file__).with_name("embedded_dof.json")


def token_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, 10000, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def prefill(model, ids) -> None:
    """Teacher and student the same way: no cache, only the last position through the LM head."""
    model(input_ids=ids, use_cache=False, logits_to_keep=1)


def new_cache(model):
    if hasattr(model.config, "dofla"):
        return RecurrentStateCache(model.config.num_hidden_layers)
    return DynamicCache(config=model.config)


def cache_bytes(cache) -> int:
    if isinstance(cache, RecurrentStateCache):
        return cache.state_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.no_grad()
def decode_start(model, context: int) -> dict:
    """Prefill ``context`` tokens into a fresh cache (timed, not counted in decoding) and take one
    untimed warm-up step: the state :func:`decode_rounds` continues from."""
    cache = new_cache(model)
    start = time.perf_counter()
    out = model(input_ids=token_ids(context), past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - start
    out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return {"model": model, "cache": cache, "token": out.logits[:, -1:].argmax(-1), "prefill": prefill_s,
            "times": []}


@torch.no_grad()
def decode_rounds(runs: dict[str, dict], steps: int) -> dict[str, dict]:
    """``steps`` rounds of one greedy single-token step of every run in turn (the loop ``generate``
    runs): the runs see the same minutes of a machine whose speed drifts. Each run gets ``per_token``
    (median seconds) and ``bytes`` (its cache)."""
    for _ in range(steps):
        for run in runs.values():
            start = time.perf_counter()
            out = run["model"](input_ids=run["token"], past_key_values=run["cache"], use_cache=True)
            run["token"] = out.logits[:, -1:].argmax(-1)
            run["times"].append(time.perf_counter() - start)
    for run in runs.values():
        run["per_token"] = statistics.median(run["times"])
        run["bytes"] = cache_bytes(run["cache"])
    return runs


def step_ratio(slow: dict, fast: dict) -> tuple[float, str]:
    """Median over rounds of slow's step time / fast's in the same round, and the range as text."""
    ratios = sorted(a / b for a, b in zip(slow["times"], fast["times"]))
    return statistics.median(ratios), f"{ratios[0]:.2f}–{ratios[-1]:.2f}"


def student_of(teacher, dims: list, chunk: int = AttentionConfig.chunk_size, **attention):
    """A learned-PRF student (``attention`` passes ``attention=``, ``window=``, ``sinks=`` to convert)."""
    return convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=dims, chunk_size=chunk, **attention).eval()


def prefill_rows(teacher, student, t: int, repeats: int) -> list[Row]:
    ids = token_ids(t)
    warm = token_ids(min(t, 256))
    for m in (teacher, student):
        prefill(m, warm)
    t_teacher, t_student, r, ratios = paired_ratio(lambda: prefill(teacher, ids), lambda: prefill(student, ids),
                                                   repeats)
    how = f"median of {repeats} interleaved pairs (ratios {ratios[0]:.2f}–{ratios[-1]:.2f})" if repeats > 1 else "1 run"
    return [Row(f"whole-model prefill T={t} (SmolLM2-135M, 30 layers, M=64)", "teacher, SDPA attention",
                "≥ 3× (MLP/LM-head bound ≈ 3.5×)", f"student {t_student:.2f} s vs teacher {t_teacher:.2f} s",
                r, r >= 3, f"use_cache=False, logits_to_keep=1, {how}")]


def decode_rows(teacher, student, t: int, short: int, steps: int) -> list[Row]:
    runs = decode_rounds({"s_short": decode_start(student, short), "s_long": decode_start(student, t),
                          "t_short": decode_start(teacher, short), "t_long": decode_start(teacher, t)}, steps)
    s_short, s_long, t_short, t_long = runs["s_short"], runs["s_long"], runs["t_short"], runs["t_long"]
    ms = lambda d: f"{d['per_token'] * 1e3:.1f} ms"  # noqa: E731
    mib = lambda d: f"{d['bytes'] / 2**20:.2f} MiB"  # noqa: E731
    flat = s_short["bytes"] == s_long["bytes"]
    growth, spread = step_ratio(s_long, s_short)
    speedup, spread_t = step_ratio(t_long, s_long)
    return [
        Row(f"student decode per token, context {t} vs {short}", "itself at the short context", "≤ 1.2×",
            f"{ms(s_long)} vs {ms(s_short)}", growth, growth <= 1.2,
            f"median of {steps} interleaved rounds, ratios {spread}"),
        Row(f"decode per token at context {t}", "teacher + DynamicCache (KV)", "≥ 3×",
            f"student {ms(s_long)} vs teacher {ms(t_long)} (at {short}: teacher {ms(t_short)})", speedup,
            speedup >= 3, f"interleaved rounds, ratios {spread_t}; context prefill (not counted): student "
            f"{s_long['prefill']:.1f} s, teacher {t_long['prefill']:.1f} s"),
        Row("decode memory: recurrent state vs KV cache", f"context {short} → {t}", "student flat",
            f"student {mib(s_short)} → {mib(s_long)}; teacher {mib(t_short)} → {mib(t_long)}",
            t_long["bytes"] / s_long["bytes"], flat, "ratio = teacher/student bytes at the long context"),
    ]


def window_rows(teacher, linear, t: int, short: int, steps: int, window: int, sinks: int) -> list[Row]:
    """Decode time and memory of the training-free sliding window (+ sinks) and the hybrid student at
    the same window, against the linear student, at the short and the long context: every run's steps
    interleaved round by round, so a growth is the same minutes' ratio, not the machine's drift."""
    dims = [64] * teacher.config.num_hidden_layers
    forms = {f"sliding window {window} + {sinks} sinks": student_of(teacher, dims, attention="sliding_window",
                                                                   window=window, sinks=sinks),
             f"hybrid, window {window} + {sinks} sinks": student_of(teacher, dims, attention="hybrid",
                                                                   window=window, sinks=sinks)}
    runs = {"linear": decode_start(linear, t)}
    for name, model in forms.items():
        runs[(name, "short")], runs[(name, "long")] = decode_start(model, short), decode_start(model, t)
    decode_rounds(runs, steps)
    lin = runs["linear"]
    rows = []
    for name in forms:
        at_short, at_long = runs[(name, "short")], runs[(name, "long")]
        growth, spread = step_ratio(at_long, at_short)
        rows.append(Row(f"{name}: decode per token and memory, context {short} → {t}", "linear student at context "
                        f"{t}", "flat in context (≤ 1.2×)", f"{at_short['per_token'] * 1e3:.1f} → "
                        f"{at_long['per_token'] * 1e3:.1f} ms (linear {lin['per_token'] * 1e3:.1f} ms); "
                        f"{at_short['bytes'] / 2**20:.2f} → {at_long['bytes'] / 2**20:.2f} MiB (linear "
                        f"{lin['bytes'] / 2**20:.2f} MiB)", growth,
                        growth <= 1.2 and at_short["bytes"] == at_long["bytes"],
                        f"ratio = per-token time at {t} / at {short}, median of {steps} interleaved rounds "
                        f"(ratios {spread})"))
    return rows


POLICIES = ("fix", "dof", "dof_clip", "dof_head")


def policy_dims(teacher, policy: str, dof: dict) -> list:
    if policy == "dof_head":
        a = AllocationConfig()  # the dof_head defaults: quantum 8, at most 2 blocks per layer
        return allocate_head_dims(dof["per_head"], 64, 64, a.head_quantum, a.head_blocks)
    return allocate_dims(dof["layer_dof"], 64, policy, 64)


def policy_rows(teacher, t: int, steps: int, repeats: int, dof: dict) -> list[Row]:
    """Prefill (T=t) and decode (context 256) cost of fix, dof, dof_head (same mean dim), dof_clip: the
    four students' prefills alternate round by round, and so do their decoding steps; ratios are the
    medians of the same round's ratios to ``fix``."""
    ids = token_ids(t)
    dims = {policy: policy_dims(teacher, policy, dof) for policy in POLICIES}
    students = {policy: student_of(teacher, d) for policy, d in dims.items()}
    pre = {policy: [] for policy in POLICIES}
    for m in students.values():
        prefill(m, token_ids(256))
    for _ in range(repeats):
        for policy, m in students.items():
            pre[policy].append(timeit(lambda m=m: prefill(m, ids), repeats=1, warmup=0))
    runs = decode_rounds({policy: decode_start(m, 256) for policy, m in students.items()}, steps)
    mean = lambda d: sum(d) / len(d)  # noqa: E731
    res = {}
    for policy in POLICIES:
        ratio = statistics.median(a / b for a, b in zip(pre[policy], pre["fix"]))
        res[policy] = (statistics.median(pre[policy]), runs[policy]["per_token"], ratio,
                       step_ratio(runs[policy], runs["fix"])[0])
    (pf, df, _, _), (pd, dd, rd, sd), (pc, dc, rc, sc), (ph, dh, rh, sh) = (res[p] for p in POLICIES)
    dims_d, dims_c, dims_h = dims["dof"], dims["dof_clip"], dims["dof_head"]
    blocks = mean([len(set(layer)) for layer in dims_h])
    how = f"; medians of {repeats} interleaved prefill rounds and {steps} decoding rounds"
    return [
        Row(f"dof vs fix, mean dim 64 (dof dims {min(dims_d)}..{max(dims_d)}), T={t}", "fix (all 64)",
            "equal within noise (±15%)",
            f"prefill {pd:.2f} vs {pf:.2f} s, decode {dd * 1e3:.1f} vs {df * 1e3:.1f} ms", rd,
            abs(rd - 1) < 0.15 and abs(sd - 1) < 0.15, f"decode ratio {sd:.2f}{how}"),
        Row(f"dof_clip (dims ≤ 64, mean {mean(dims_c):.1f}) vs fix, T={t}", "fix (all 64)", "cheaper",
            f"prefill {pc:.2f} vs {pf:.2f} s, decode {dc * 1e3:.1f} vs {df * 1e3:.1f} ms", rc,
            rc < 1 and sc <= 1.05, f"decode ratio {sc:.2f}{how}"),
        Row(f"dof_head (per-head dims, mean {mean_dim(dims_h):.1f}, {blocks:.1f} blocks/layer) vs fix, T={t}",
            "fix (all 64)", "equal within noise (±15%)",
            f"prefill {ph:.2f} vs {pf:.2f} s, decode {dh * 1e3:.1f} vs {df * 1e3:.1f} ms", rh,
            abs(rh - 1) < 0.15 and abs(sh - 1) < 0.15, f"decode ratio {sh:.2f}{how}"),
    ]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=16384, help="prefill length and long decode context")
    parser.add_argument("--short", type=int, default=1024, help="short decode context")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--repeats", type=int, default=1, help="prefill repeats at --seq-len")
    parser.add_argument("--policy-seq-len", type=int, default=4096)
    parser.add_argument("--dof-json", default=str(EMBEDDED_DOF_JSON),
                        help="dof.json whose layer_dof / per_head drive the policy rows (default: embedded)")
    parser.add_argument("--chunk", type=int, default=AttentionConfig.chunk_size, help="student chunk_size")
    parser.add_argument("--window", type=int, default=64, help="window of the sliding-window and hybrid rows")
    parser.add_argument("--sinks", type=int, default=4, help="sinks of the sliding-window and hybrid rows")
    parser.add_argument("--skip", default="", help="comma list of: prefill,decode,window,policy")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.seq_len, args.short, args.steps, args.policy_seq_len = 1024, 256, 4, 512
    skip = set(filter(None, args.skip.split(",")))
    dof = json.loads(Path(args.dof_json).read_text())
    teacher, _ = load_teacher(EMBEDDED)
    teacher.eval()
    student = student_of(teacher, [64] * teacher.config.num_hidden_layers, args.chunk)
    rows = []
    if "prefill" not in skip:
        rows += prefill_rows(teacher, student, args.seq_len, args.repeats)
    if "decode" not in skip:
        rows += decode_rows(teacher, student, args.seq_len, args.short, args.steps)
    if "window" not in skip:
        rows += window_rows(teacher, student, args.seq_len, args.short, args.steps, args.window, args.sinks)
    if "policy" not in skip:
        rows += policy_rows(teacher, args.policy_seq_len, args.steps, 1 if args.quick else 2, dof)
    return rows


if __name__ == "__main__":
    finish("model", main())
