"""Held-out next-token loss / perplexity and per-layer attention-output error."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from dofla.attention import softmax_attention
from dofla.models import capture_qkv


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, batch_size: int = 2, desc: str = "eval loss") -> float:
    """Mean next-token NLL over every predicted position of ``tokens`` (S, L)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, unit="batch", leave=False):
        batch = tokens[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return total / count


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def attention_errors(teacher, student, tokens: torch.Tensor) -> list[float]:
    """Per layer, ||y_student − y_softmax|| / ||y_softmax|| on the teacher's held-out q, k, v.

    Every layer sees the teacher's own activations, so each error is that layer's alone.
    """
    sums = None
    for row in tokens.split(1):
        layers = capture_qkv(teacher, row.to(next(teacher.parameters()).device))
        errs = []
        for (q, k, v), attn in zip(layers, student.student_attentions()):
            exact = softmax_attention(q, k, v, causal=True)
            approx, _ = attn(q, k, v)
            errs.append(((approx - exact).norm() ** 2, exact.norm() ** 2))
        sums = errs if sums is None else [(a + c, b + d) for (a, b), (c, d) in zip(sums, errs)]
    return [(num / den).sqrt().item() for num, den in sums]
