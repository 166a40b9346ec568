"""Quadratic reference attentions, layout (B, H, T, D). They materialise T×S matrices (and the
linear one T×S×M), so they are for tests and small inputs only."""
from __future__ import annotations

import math

import torch


def _causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool, True where key j is visible to query i. Queries are the last T of the S
    positions, so a block of new queries against a longer key history is masked correctly."""
    i = torch.arange(t, device=device)[:, None] + (s - t)
    j = torch.arange(s, device=device)[None, :]
    return j <= i


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """q (B, H, T, d); k (B, H_kv, S, d); v (B, H_kv, S, dv) -> (B, H, T, dv).

    Scores q·k / sqrt(d). GQA: H_kv must divide H; each group of H / H_kv query heads reads one
    key/value head (repeat_interleave, the Hugging Face convention).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"key/value heads ({kv_heads}) must divide query heads ({heads})")
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = _causal_mask(q.shape[2], k.shape[2], q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def log_kernel_matrix(log_q: torch.Tensor, log_k: torch.Tensor) -> torch.Tensor:
    """log K̂_ij = logsumexp_m(log_q[i, m] + log_k[j, m]): (B, H, T, M), (B, H, S, M) -> (B, H, T, S).

    Materialises (B, H, T, S, M); exact in log space, so no overflow at any norm.
    """
    return torch.logsumexp(log_q[..., :, None, :] + log_k[..., None, :, :], dim=-1)


def kernel_matrix(log_q: torch.Tensor, log_k: torch.Tensor) -> torch.Tensor:
    """K̂_ij = Φ(q_i)·Φ(k_j), (B, H, T, S). May overflow at large norms; prefer the log form."""
    return log_kernel_matrix(log_q, log_k).exp()


def masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where −inf marks hidden keys; a row with none visible gives 0s."""
    seen = torch.isfinite(scores).any(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen


def linear_attention_naive(
    log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    *, key_valid: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_i = Σ_j K̂(q_i, k_j) v_j / Σ_j K̂(q_i, k_j), via a softmax over log K̂.

    log_q (B, H, T, M), log_k (B, H, S, M) log features; v (B, H, S, dv) -> (B, H, T, dv).
    key_valid (B, S) bool: False keys (padding) are hidden; a row seeing no key outputs 0.
    log_decay (B, H, S) ≤ 0, the gate: K̂_ij is weighted by exp(A_i − A_j), A = cumsum(log_decay)
    over the S positions (a padding key's decay counts as 0).
    """
    visible = torch.ones(log_q.shape[2], log_k.shape[2], dtype=torch.bool, device=log_q.device)
    if causal:
        visible = _causal_mask(log_q.shape[2], log_k.shape[2], log_q.device)
    if key_valid is not None:
        visible = visible & key_valid.to(torch.bool)[:, None, None, :]
        log_k = log_k.masked_fill(~key_valid.to(torch.bool)[:, None, :, None], 0.0)  # finite: no NaN grads
    log_kernel = log_kernel_matrix(log_q, log_k)
    if log_decay is not None:
        if key_valid is not None:
            log_decay = log_decay.masked_fill(~key_valid.to(torch.bool)[:, None, :], 0.0)
        cumulative = log_decay.cumsum(-1)  # (B, H, S)
        log_kernel = log_kernel + cumulative[..., -log_q.shape[2]:, None] - cumulative[..., None, :]
    log_kernel = log_kernel.masked_fill(~visible, float("-inf"))
    return masked_softmax(log_kernel).to(v.dtype) @ v
