"""Held-out next-token loss / perplexity and per-layer attention-output error."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from dofla import distributed
from dofla.attention import linear_attention_chunked, softmax_attention
from dofla.attention.sliding import sliding_window_naive
from dofla.feature_maps.blocks import for_each_block
from dofla.models import capture_qkv, get_adapter


def next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L−1) NLL of each next token: ``logits`` (B, L, V) of ``tokens`` (B, L), position p predicting token
    p + 1. Cross-entropy over B·(L−1) contiguous rows of V, the same values as over the (B, V, L−1)
    transpose (:func:`next_token_nll_reference`) and about 4× faster on the CPU, where the transpose's
    class axis is reduced with a stride."""
    B, L, V = logits.shape
    rows = logits[:, :-1].float().reshape(B * (L - 1), V)
    return torch.nn.functional.cross_entropy(rows, tokens[:, 1:].reshape(-1), reduction="none").view(B, L - 1)


def next_token_nll_reference(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`next_token_nll` as PyTorch's (N, C, d) form reads it: the class axis second."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), tokens[:, 1:], reduction="none")


@torch.no_grad()
def heldout_losses(model, tokens: torch.Tensor, batch_size: int = 2, desc: str = "eval loss",
                   data_parallel: bool = False) -> torch.Tensor:
    """(S,) float64: each sequence's mean next-token NLL over its L−1 predicted positions, ``tokens`` (S, L).

    Every sequence has the same number of positions, so their mean is the held-out loss. Under
    torchrun (``data_parallel``) each rank scores its share of the batches and the rows are summed
    across ranks (every rank must call it; the others' rows are zeros until then).
    """
    device = next(model.parameters()).device
    sums = torch.zeros(tokens.shape[0], dtype=torch.float64)
    starts = range(0, tokens.shape[0], batch_size)
    starts = distributed.mine(starts) if data_parallel else starts
    for start in tqdm(starts, desc=desc, unit="batch", leave=False, disable=not distributed.is_main()):
        batch = tokens[start : start + batch_size].to(device)
        nll = next_token_nll(model(input_ids=batch, use_cache=False).logits, batch)  # (B, L-1)
        sums[start : start + batch.shape[0]] = nll.double().sum(-1).cpu()
    if data_parallel:
        sums = torch.tensor(distributed.sum_across(sums.tolist()), dtype=torch.float64)
    return sums / (tokens.shape[1] - 1)


def heldout_loss(model, tokens: torch.Tensor, batch_size: int = 2, desc: str = "eval loss",
                 data_parallel: bool = False) -> float:
    """Mean next-token NLL over every predicted position of ``tokens`` (S, L): S·(L−1) positions."""
    return heldout_losses(model, tokens, batch_size, desc, data_parallel).mean().item()


def perplexity(model, tokens: torch.Tensor, batch_size: int = 2) -> float:
    """exp(held-out loss); inf rather than an OverflowError for a broken student."""
    loss = heldout_loss(model, tokens, batch_size)
    return math.exp(loss) if loss < 700 else float("inf")


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx − exact|| / ||exact|| (Frobenius over all elements)."""
    return ((approx - exact).norm() / exact.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def layer_attention_error(feature_map, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          chunk_size: int = 128) -> float:
    """Causal relative error of linear attention with ``feature_map`` against softmax attention.

    q (B, H, L, d); k, v (B, H_kv, L, d) with GQA keys/values expanded per query group.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    def attend(fm, q, k, v, state=None):
        return linear_attention_chunked(fm.log_features(q), fm.log_features(k), v, chunk_size=chunk_size)

    approx, _ = for_each_block(feature_map, attend, q, k, v)
    return relative_error(approx, softmax_attention(q, k, v, causal=True))


def teacher_attention(geometry):
    """(layer, q, k, v) -> the teacher's own attention output: causal softmax, restricted to the
    layer's sliding window and soft-capped where the teacher is (q (B, H, T, d), k/v (B, H_kv, T, d))."""
    windows = geometry.layer_windows or (None,) * geometry.num_layers

    def attend(i: int, q, k, v):
        if windows[i] is None and geometry.softcap is None:
            return softmax_attention(q, k, v, causal=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return sliding_window_naive(q, k, v, windows[i] or q.shape[2], sinks=0, softcap=geometry.softcap)
    return attend


@torch.no_grad()
def attention_errors(teacher, student, tokens: torch.Tensor, batch_size: int = 1,
                     data_parallel: bool = False) -> list[float]:
    """Per layer, ||y_student − y_softmax|| / ||y_softmax|| on the teacher's q, k, v of ``tokens`` (S, L).

    Every layer sees the teacher's own activations, so each error is that layer's alone. Squared
    norms are summed over batches of ``batch_size`` sequences (memory: one batch's q, k, v of all
    layers), so the result is the error over all of ``tokens``, not a mean of per-batch ratios.
    ``data_parallel``: batches shared out across torchrun ranks, sums added across them.
    """
    device = next(teacher.parameters()).device
    num_layers = len(student.student_attentions())
    reference = teacher_attention(get_adapter(teacher).geometry(teacher.config))
    sums = [[0.0, 0.0] for _ in range(num_layers)]
    batches = tokens.split(batch_size)
    batches = distributed.mine(batches) if data_parallel else batches
    for batch in tqdm(batches, desc="attention error", unit="batch", leave=False, disable=not distributed.is_main()):
        layers = capture_qkv(teacher, batch.to(device))
        batch_sums = []
        for i, ((q, k, v), attn) in enumerate(zip(layers, student.student_attentions())):
            exact = reference(i, q, k, v)
            approx, _ = attn(q, k, v)
            batch_sums.append([(approx - exact).norm().item() ** 2, exact.norm().item() ** 2])
        sums = [[a + c, b + d] for (a, b), (c, d) in zip(sums, batch_sums)]
    if data_parallel:
        flat = distributed.sum_across([x for pair in sums for x in pair])
        sums = [flat[2 * i: 2 * i + 2] for i in range(num_layers)]
    return [math.sqrt(num / max(den, 1e-30)) for num, den in sums]
