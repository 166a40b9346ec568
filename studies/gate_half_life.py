"""What did a gated student's decay gate learn? Per layer: the gate strengths α, the mean log decay per
token on held-out text and the heads' memory half-lives (and a hybrid's learned linear scales β, if any).

``python -m studies.gate_half_life RUN [--seqs 2] [--out FILE]``

A gated linear layer multiplies its state by e^{a_t} before each key, a_t = −α_h·softplus(w_h·v_t + b_h)
(``attention.gate=scalar``). A head whose mean a is ā forgets half of what it holds in ln 2 / |ā|
tokens: its half-life. The run's final student (the last stage it wrote) reads ``--seqs`` of the run's
held-out sequences; each head's ā is its mean over tokens and sequences. Prints markdown.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from studies.paired_heldout import final_student, held_out


@torch.no_grad()
def gate_statistics(model, tokens: torch.Tensor) -> list[dict]:
    """Per gated layer of ``model`` on ``tokens`` (S, L): α (min / median / max over heads), the mean
    log decay per token, the heads' half-lives in tokens (ln 2 / |mean decay|; inf when closed)."""
    gated = [(layer, a) for layer, a in enumerate(model.student_attentions()) if a.gate is not None]
    if not gated:
        raise SystemExit("this student has no decay gate (attention.gate=scalar); nothing to read")
    decays = {layer: [] for layer, _ in gated}
    hooks = [a.gate.register_forward_hook(lambda m, args, out, layer=layer: decays[layer].append(out.float()))
             for layer, a in gated]
    try:
        for row in tokens:
            model(input_ids=row[None], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    rows = []
    for layer, attention in gated:
        per_head = torch.cat([d.mean(dim=2) for d in decays[layer]]).mean(0)  # (H,) mean log decay per token
        half_lives = [math.log(2) / -x if x < 0 else math.inf for x in per_head.tolist()]
        alpha = attention.gate.alpha.detach().float()
        beta = attention.linear_log_scale
        rows.append({"layer": layer, "alpha": _spread(alpha), "decay": per_head.mean().item(),
                     "half_lives": half_lives, "scale": None if beta is None else _spread(beta.detach().float())})
    return rows


def _spread(x: torch.Tensor) -> tuple[float, float, float]:
    return x.min().item(), x.median().item(), x.max().item()


def table(rows: list[dict], short: int = 512) -> str:
    scaled = any(r.get("scale") is not None for r in rows)
    lines = ["| layer | α min / median / max | mean log decay per token | median half-life (tokens) | "
             f"heads with half-life < {short} |" + (" linear scale β min / median / max |" if scaled else ""),
             "|---|---|---|---|---|" + ("---|" if scaled else "")]
    for r in rows:
        lives = sorted(r["half_lives"])
        median = lives[(len(lives) - 1) // 2]
        share = sum(h < short for h in lives) / len(lives)
        beta = r.get("scale")
        scale = "" if not scaled else " – |" if beta is None else f" {beta[0]:+.2f} / {beta[1]:+.2f} / {beta[2]:+.2f} |"
        lines.append(f"| {r['layer']} | {r['alpha'][0]:.4f} / {r['alpha'][1]:.4f} / {r['alpha'][2]:.4f} | "
                     f"{r['decay']:.4f} | {median:.0f} | {share:.0%} |{scale}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished gated run's directory")
    parser.add_argument("--seqs", type=int, default=2, help="held-out sequences to read (default 2)")
    parser.add_argument("--out", type=Path, help="write the markdown here too")
    args = parser.parse_args(argv)
    from dofla.models import load_student

    student = final_student(args.run)
    model = load_student(student).eval()
    tokens = held_out(args.run, long=False)[: args.seqs]
    text = (f"`python -m studies.gate_half_life {args.run} --seqs {args.seqs}`\n\n{student}: {len(tokens)} "
            f"held-out sequences of {tokens.shape[1]} tokens\n\n{table(gate_statistics(model, tokens))}\n")
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
