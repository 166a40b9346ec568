"""Held-out next-token loss / perplexity and per-layer attention-output error."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from dofla.attention import linear_attention_chunked, softmax_attention
from dofla.models import capture_qkv


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, batch_size: int = 2, desc: str = "eval loss") -> float:
    """Mean next-token NLL over every predicted position of ``tokens`` (S, L): S·(L−1) positions."""
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


def perplexity(model, tokens: torch.Tensor, batch_size: int = 2) -> float:
    """exp(held-out loss); inf rather than an OverflowError for a broken student."""
    loss = heldout_loss(model, tokens, batch_size)
    return math.exp(loss) if loss < 700 else float("inf")


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx − exact|| / ||exact|| (Frobenius over all elements)."""
    return ((approx - exact).norm() / exact.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def layer_attention_error(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          chunk_size: int = 64) -> float:
    """Causal relative error of linear attention with ``feature_map`` against softmax attention.

    q (B, H, L, d); k, v (B, H_kv, L, d) with GQA keys/values expanded per query group.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    approx, _ = linear_attention_chunked(feature_map.log_features(q), feature_map.log_features(k), v,
                                         chunk_size=chunk_size)
    return relative_error(approx, softmax_attention(q, k, v, causal=True))


@torch.no_grad()
def attention_errors(teacher, student, tokens: torch.Tensor, batch_size: int = 1) -> list[float]:
    """Per layer, ||y_student − y_softmax|| / ||y_softmax|| on the teacher's q, k, v of ``tokens`` (S, L).

    Every layer sees the teacher's own activations, so each error is that layer's alone. Squared
    norms are summed over batches of ``batch_size`` sequences (memory: one batch's q, k, v of all
    layers), so the result is the error over all of ``tokens``, not a mean of per-batch ratios.
    """
    device = next(teacher.parameters()).device
    sums: list[list[float]] | None = None
    for batch in tqdm(tokens.split(batch_size), desc="attention error", unit="batch", leave=False):
        layers = capture_qkv(teacher, batch.to(device))
        batch_sums = []
        for (q, k, v), attn in zip(layers, student.student_attentions()):
            exact = softmax_attention(q, k, v, causal=True)
            approx, _ = attn(q, k, v)
            batch_sums.append([(approx - exact).norm().item() ** 2, exact.norm().item() ** 2])
        sums = batch_sums if sums is None else [[a + c, b + d] for (a, b), (c, d) in zip(sums, batch_sums)]
    return [math.sqrt(num / max(den, 1e-30)) for num, den in sums]
