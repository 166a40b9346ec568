"""How far is the top-k KL (``distill.teacher_topk``) from the exact one on the embedded SmolLM2?

``python -m studies.topk_kl [--seqs 2] [--seq-len 512] [--ks 16,64,256,1024] [--student DIR]``

The distill stage's loss against the teacher's top k tokens and the rest's mass (the KL over k + 1
buckets, :mod:`dofla.train.kl_targets`) is at most the exact KL, and its gradient differs on the
tokens outside the top k. For each student this prints, per k: the top-k KL's shortfall relative to
the exact KL, and the relative error ‖g_k − g‖ / ‖g‖ and cosine of its gradient, with respect to the
student's logits and to the parameters the stage trains by default (features and attention
projections). The text is the embedded source's training text (``--seqs`` rows of ``--seq-len``
tokens after the first 65,536, where the default layerwise stage stops). Students: three that need
no training (linear and hybrid attention with freshly converted Hedgehog features, and the
training-free sliding window), or a saved student (``--student``). Prints markdown.
"""
from __future__ import annotations

import argparse
import copy

import torch

from dofla.data import build_source, pack_tokens
from dofla.models import EMBEDDED, convert, load_student, load_teacher
from dofla.train import exact_kl, prepare_trainable, topk_targets

STUDENTS = {
    "linear, fresh Hedgehog features": {"feature_map": "hedgehog", "attention": "linear"},
    "hybrid (window 64, 4 sinks), fresh Hedgehog features": {"feature_map": "hedgehog", "attention": "hybrid",
                                                             "window": 64, "sinks": 4},
    "sliding window 64, 4 sinks (training-free)": {"attention": "sliding_window", "window": 64, "sinks": 4},
}


def text(tokenizer, seqs: int, seq_len: int, skip: int = 65536) -> torch.Tensor:
    """``seqs`` rows of ``seq_len`` tokens of the embedded training text, after its first ``skip`` tokens."""
    rows = pack_tokens(build_source("embedded").texts("train"), tokenizer, seq_len, skip + seqs * seq_len)
    return rows[-seqs:]


def gradients(model, params, logits, loss) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d logits, d loss / d params), flattened, in float64 (a float32 dot product over tens of
    millions of entries can put a cosine above 1); the graph is kept for the next loss."""
    grads = torch.autograd.grad(loss, [logits, *params], retain_graph=True, allow_unused=True)
    flat = torch.cat([torch.zeros(p.numel()) if g is None else g.flatten() for p, g in zip(params, grads[1:])])
    return grads[0].flatten().double(), flat.double()


def compare(model, params, teacher, ids: torch.Tensor, ks: list[int]) -> list[dict]:
    """Per k: the top-k KL's shortfall and its gradients' errors against the exact KL's, on ``ids``."""
    with torch.no_grad():
        target = teacher(input_ids=ids, use_cache=False).logits
    logits = model(input_ids=ids, use_cache=False).logits
    exact = exact_kl(logits, target)
    g_logits, g_params = gradients(model, params, logits, exact)
    rows = [{"k": "exact", "kl": exact.item()}]
    for k in ks:
        approx = topk_targets(target, k).kl(logits, 1.0)
        a_logits, a_params = gradients(model, params, logits, approx)
        rows.append({"k": k, "kl": approx.item(), "shortfall": 1 - approx.item() / exact.item(),
                     **{f"{name}_err": ((a - g).norm() / g.norm()).item() for name, a, g in
                        (("logits", a_logits, g_logits), ("params", a_params, g_params))},
                     **{f"{name}_cos": torch.nn.functional.cosine_similarity(a, g, dim=0).item() for name, a, g in
                        (("logits", a_logits, g_logits), ("params", a_params, g_params))}})
    return rows


def table(name: str, rows: list[dict]) -> str:
    lines = [f"**{name}**: exact KL {rows[0]['kl']:.4f} nats/token", "",
             "| k | top-k KL | shortfall | logit grad. error | cosine | param. grad. error | cosine |",
             "|---|---|---|---|---|---|---|"]
    for r in rows[1:]:
        lines.append(f"| {r['k']} | {r['kl']:.4f} | {r['shortfall']:.2%} | {r['logits_err']:.2%} | "
                     f"{r['logits_cos']:.5f} | {r['params_err']:.2%} | {r['params_cos']:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ks", default="16,64,256,1024")
    parser.add_argument("--student", help="a saved student directory instead of the three fresh ones")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    teacher, tokenizer = load_teacher(EMBEDDED)
    ids = text(tokenizer, args.seqs, args.seq_len)
    ks = [int(k) for k in args.ks.split(",")]
    students = {args.student: None} if args.student else STUDENTS
    print(f"{args.seqs} × {args.seq_len} tokens of the embedded training text, after its first 65,536\n")
    for name, options in students.items():
        student = load_student(name) if options is None else convert(copy.deepcopy(teacher), dims=[64] * 30, **options)
        train = ["attention"] if options is not None and options["attention"] == "sliding_window" else ["features",
                                                                                                      "attention"]
        model, groups = prepare_trainable(student, train)
        model.eval()
        params = [p for _, ps in groups for p in ps]
        per_row = [compare(model, params, teacher, row[None], ks) for row in ids]
        rows = [{key: (sum(r[i][key] for r in per_row) / len(per_row) if key != "k" else per_row[0][i][key])
                 for key in per_row[0][i]} for i in range(len(ks) + 1)]
        print(table(name, rows) + f"\n\n(means over {len(ids)} sequences; trains {', '.join(train)})\n", flush=True)


if __name__ == "__main__":
    main()
