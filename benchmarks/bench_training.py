"""Training cost per sample: layerwise losses on cached q/k vs direct (end-to-end) training.

Layerwise: for each of the 30 layers, forward + backward of the loss (``softmax`` or ``l2``) of that
layer's learned_prf feature map on one sequence's cached q, k (1, 9, L, 64). Direct: forward +
backward of the whole converted student on the same sequence (next-token loss), only the feature
map parameters trainable.

    python -m benchmarks.bench_training [--seq-len 512] [--repeats 2] [--threads N] [--quick]

With a C++ compiler, a row times the softmax step with the loss compiled (``train.compile``). Two
rows time the ``l2`` and ``output`` losses without (L, L) matrices (:mod:`dofla.train.causal_losses`)
against their plain (L, L) forms on the first 4 stand-in layers, with each one's traced peak. The
last row times the distill stage's KL step with the LM head in chunks (``distill.logit_chunk``)
against the whole logits, with each one's traced peak memory.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch

from benchmarks.common import Row, add_common_args, finish, paired_ratio, set_threads, timeit
from dofla.feature_maps import build_feature_map
from dofla.models import EMBEDDED, convert, load_teacher
from dofla.train.losses import LOSSES, compiled_loss, l2_dense, output_dense, softmax_dense
from dofla.validate_training import cxx_compiler

LAYERS, HEADS, D, M = 30, 9, 64, 64

def cached_activations(length: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random stand-ins for cached q, k per layer: (1, 9, L, 64), GQA keys already expanded,
    with |x|²/sqrt(d) ≈ 10–40 (a per-layer scale drawn in that range)."""
    g = torch.Generator().manual_seed(seed)
    acts = []
    for _ in range(LAYERS):
        target = 10 + 30 * torch.rand((), generator=g).item()  # |x|²/sqrt(d)
        scale = math.sqrt(target * math.sqrt(D) / D)
        acts.append(tuple(torch.randn(1, HEADS, length, D, generator=g) * scale for _ in range(2)))
    return acts


def layerwise_step(maps, acts, loss) -> None:
    for fm, (q, k) in zip(maps, acts):
        fm.zero_grad(set_to_none=True)
        loss(fm.log_features(q), fm.log_features(k), q, k, causal=True).backward()


def direct_setup(length: int):
    teacher, _ = load_teacher(EMBEDDED)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[M] * LAYERS)
    del teacher
    student.requires_grad_(False)
    student.train()
    for attention in student.student_attentions():
        attention.feature_map.requires_grad_(True)
    ids = torch.randint(100, 10000, (1, length), generator=torch.Generator().manual_seed(0))
    return student, ids


def direct_step(student, ids) -> None:
    student.zero_grad(set_to_none=True)
    student(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def main(argv: list[str] | None = None) -> list[Row]:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--losses", default="softmax,l2")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.seq_len, args.repeats = 128, 1
    length = args.seq_len
    student, ids = direct_setup(length)
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    direct_step(student, ids)  # warm-up
    acts = cached_activations(length)
    layer_maps = [build_feature_map("learned_prf", HEADS, D, M, seed=i) for i in range(LAYERS)]
    rows = []
    for name in args.losses.split(","):
        loss = LOSSES.get(name)
        layerwise_step(layer_maps, acts, loss)  # warm-up
        t_layer, t_direct, r, ratios = paired_ratio(lambda: layerwise_step(layer_maps, acts, loss),
                                                    lambda: direct_step(student, ids), args.repeats)
        rows.append(Row(f"training cost per sample, layerwise {name} loss (L={length}, {LAYERS} layers)",
                        "direct: whole student fwd+bwd, feature params trainable", "≤ 1/5",
                        f"layerwise {t_layer:.2f} s vs direct {t_direct:.2f} s", r, r <= 0.2,
                        f"{trainable / 1e6:.2f}M trainable params; optimizer step not timed on either side; "
                        f"median of {args.repeats} interleaved pairs (ratios {ratios[0]:.2f}–{ratios[-1]:.2f})"))
    if "softmax" in args.losses.split(",") and cxx_compiler() is not None:
        rows.append(compiled_row(layer_maps, acts, length, args.repeats))
    rows += causal_rows(layer_maps, acts, length, args.repeats)
    rows.append(chunked_kl_row(student, ids, args.repeats))
    return rows


def chunked_kl_row(student, ids, repeats: int, chunk: int = 128) -> Row:
    """The distill stage's KL step (teacher forward, student forward and backward, features and
    attention trainable) with ``distill.logit_chunk=chunk`` against the whole logits: time and peak."""
    from dofla.train.capacity import traced_peak
    from dofla.train.distill import DistillSchedule, accumulate, prepare_trainable

    teacher, _ = load_teacher(EMBEDDED)
    model, _ = prepare_trainable(student, ["features", "attention"])
    model.eval()
    results = {}
    for c in (0, chunk):
        s = DistillSchedule(steps=1, micro_batch_size=1, lr=1e-4, feature_lr=1e-3, logit_chunk=c)
        step = lambda: (model.zero_grad(set_to_none=True), accumulate(model, teacher, ids, s))  # noqa: E731
        results[c] = timeit(step, repeats=repeats), traced_peak(step)
    (whole, whole_peak), (chunked, chunked_peak) = results[0], results[chunk]
    return Row(f"distill KL step, LM head in chunks of {chunk} (distill.logit_chunk, L={ids.shape[1]})",
               "the whole logits", "≥ 0.9× (memory, not speed)",
               f"chunked {chunked:.2f} s vs whole {whole:.2f} s", whole / chunked, chunked <= whole / 0.9,
               f"peak {chunked_peak / 2**20:.0f} MiB vs {whole_peak / 2**20:.0f} MiB of activations")


# (the loss as the trainer calls it, its plain (L, L) form), each taking (log_q, log_k, q, k, v)
CAUSAL_FORMS = {
    "l2": (lambda lq, lk, q, k, v: LOSSES.get("l2")(lq, lk, q, k),
           lambda lq, lk, q, k, v: l2_dense(lq, lk, q, k, True, 0, "row_max")),
    "output": (lambda lq, lk, q, k, v: LOSSES.get("output")(lq, lk, q, k, v=v),
               lambda lq, lk, q, k, v: output_dense(lq, lk, q, k, v, True, 0)),
    # a hybrid layer as in the README's hybrid rows (window 64, 4 sinks), with the default loss
    "hybrid softmax": (lambda lq, lk, q, k, v: LOSSES.get("softmax")(lq, lk, q, k, window=64, sinks=4),
                       lambda lq, lk, q, k, v: softmax_dense(lq, lk, q, k, True, 64, 4)),
}


def causal_rows(layer_maps, acts, length: int, repeats: int, layers: int = 4) -> list[Row]:
    """The causal ``l2`` (on pieces), ``output`` (chunked kernel against fused attention) and hybrid
    ``softmax`` (pieces and an exact band) losses against their plain (L, L) forms: forward +
    backward over ``layers`` stand-in layers, interleaved pairs, and the traced peak of one layer's
    step."""
    from dofla.train.capacity import traced_peak

    g = torch.Generator().manual_seed(1)
    values = [torch.randn(q.shape, generator=g) for q, _ in acts[:layers]]

    def steps(loss, count=layers):
        def run():
            for fm, (q, k), v in list(zip(layer_maps, acts, values))[:count]:
                fm.zero_grad(set_to_none=True)
                loss(fm.log_features(q), fm.log_features(k), q, k, v).backward()
        return run

    rows = []
    for name, (fast, plain) in CAUSAL_FORMS.items():
        steps(fast)(), steps(plain)()  # warm-up
        t_plain, t_fast, r, ratios = paired_ratio(steps(plain), steps(fast), repeats)
        peak_fast, peak_plain = traced_peak(steps(fast, 1)), traced_peak(steps(plain, 1))
        rows.append(Row(f"{name} loss + backward, causal, without (L, L) matrices (L={length}, {layers} layers)",
                        "its plain (L, L) form, interleaved", "faster, less memory",
                        f"{t_fast:.2f} vs {t_plain:.2f} s; one layer's peak {peak_fast / 2**20:.0f} vs "
                        f"{peak_plain / 2**20:.0f} MiB", r, r > 1 and peak_fast < peak_plain,
                        f"median of {repeats} pairs (ratios {ratios[0]:.2f}–{ratios[-1]:.2f})"))
    return rows


def compiled_row(layer_maps, acts, length: int, repeats: int) -> Row:
    """``train.compile``: the layerwise softmax step with the loss under torch.compile (compiled once,
    in the warm-up call, for all 30 layers) against the eager loss."""
    eager = timeit(lambda: layerwise_step(layer_maps, acts, LOSSES.get("softmax")), repeats=repeats)
    compiled = timeit(lambda: layerwise_step(layer_maps, acts, compiled_loss("softmax")), repeats=repeats)
    return Row(f"layerwise softmax step, loss compiled (train.compile, L={length}, {LAYERS} layers)",
               "the eager loss", "≥ 1× (no slower)", f"compiled {compiled:.2f} s vs eager {eager:.2f} s",
               eager / compiled, compiled <= eager, "compilation itself (once per shape) not timed")


if __name__ == "__main__":
    finish("training", main())
