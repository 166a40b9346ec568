"""Layerwise distillation losses (METHOD.md §3), computed stably in log space.

All take log features log_q, log_k (B, H, L, M), teacher q, k (B, H, L, d) (k expanded to H
heads, q scaled so the kernel is exp(q·k/sqrt(d))), and return a scalar averaged over query rows.
``window > 0`` trains a hybrid layer: keys i−W < j ≤ i are exact softmax, only older keys use K̂.
"""
from __future__ import annotations

import math

import torch

from dofla.registry import Registry

LOSSES: Registry = Registry("layerwise loss")


def shifted_student_kernel(log_q: torch.Tensor, log_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S (B, H, L, L) and r (B, H, L, 1) with K̂_ij = e^{r_i} S_ij, computed without overflow.

    With c_m = max_j log_k[j, m] and r_i = max_m(log_q[i, m] + c_m) (both detached, so they are
    constants of the graph), S_ij = Σ_m exp(log_q + c − r)_im exp(log_k − c)_jm ≤ M.
    """
    fq, fk, r = shifted_features(log_q, log_k, with_shift=True)
    return fq @ fk.transpose(-1, -2), r


def shifted_features(log_q: torch.Tensor, log_k: torch.Tensor, with_shift: bool = False):
    """exp(log_q + c − r), exp(log_k − c) (each entry ≤ 1; S = their product), and r if asked."""
    c = log_k.detach().amax(dim=2, keepdim=True)
    u = log_q + c
    r = u.detach().amax(dim=-1, keepdim=True)
    fq, fk = torch.exp(u - r), torch.exp(log_k - c)
    return (fq, fk, r) if with_shift else (fq, fk)


def _log_floor(s: torch.Tensor) -> torch.Tensor:
    """log with a floor at the dtype's smallest normal: an underflowed entry costs a large finite loss."""
    return torch.log(s.clamp_min(torch.finfo(s.dtype).tiny))


def log_student_kernel(log_q: torch.Tensor, log_k: torch.Tensor) -> torch.Tensor:
    """(B, H, L, L) log K̂_ij = log Φ(q_i)·Φ(k_j) via shifted exponentials (no overflow)."""
    s, r = shifted_student_kernel(log_q, log_k)
    return r + _log_floor(s)


def teacher_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def _masks(length: int, causal: bool, window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, approximated): which (i, j) the row sees, and which of those use K̂."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    visible = j <= i if causal else torch.ones(length, length, dtype=torch.bool, device=device)
    approximated = visible & (j <= i - window) if window > 0 else visible
    return visible, approximated


@LOSSES.register("softmax")
def softmax_loss(log_q, log_k, q, k, causal: bool = True, window: int = 0) -> torch.Tensor:
    """Cross-entropy from the teacher's attention distribution p to the student's p̂ (the paper's).

    Without a window the row shift e^{r_i} cancels in p̂, so CE_i = log Σ_j S_ij − Σ_j p_ij log S_ij:
    no (L, L) log-softmax, which is most of the cost on CPU. The normaliser Σ_{j≤i} S_ij is the
    linear-attention denominator, φ̃(q_i)·Σ_{j≤i} φ̃(k_j): a prefix sum over L·M, not a pass over L².
    """
    if window > 0:
        return _hybrid_softmax_loss(log_q, log_k, q, k, causal, window)
    s = teacher_logits(q, k)
    visible, _ = _masks(s.shape[-1], causal, window, s.device)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    fq, fk = shifted_features(log_q, log_k)
    shifted = fq @ fk.transpose(-1, -2)
    key_sums = fk.cumsum(dim=-2) if causal else fk.sum(dim=-2, keepdim=True)
    normaliser = _log_floor((fq * key_sums).sum(-1))
    return (normaliser - (p * _log_floor(shifted)).sum(-1)).mean()


def _hybrid_softmax_loss(log_q, log_k, q, k, causal: bool, window: int) -> torch.Tensor:
    """The softmax loss when the last ``window`` keys are exact: both kernels need their true scale."""
    s = teacher_logits(q, k)
    visible, approx = _masks(s.shape[-1], causal, window, s.device)
    student = torch.where(approx, log_student_kernel(log_q, log_k), s).masked_fill(~visible, float("-inf"))
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    log_p_hat = torch.log_softmax(student, dim=-1).masked_fill(~visible, 0.0)
    return -(p * log_p_hat).sum(-1).mean()


@LOSSES.register("l2")
def l2_loss(log_q, log_k, q, k, causal: bool = True, window: int = 0, scale: str = "row_max") -> torch.Tensor:
    """Mean over rows of Σ_j (K_ij − K̂_ij)² on the approximated pairs.

    ``scale="row_max"`` divides row i of both kernels by the teacher's max_j K_ij (finite at real
    norms); ``"none"`` is the paper's literal form. Both are computed in float64; the literal form
    is also returned in float64, because at real norms (K up to e^70) its value overflows fp32.
    Its gradient can still overflow the fp32 features; the trainer reports that as non-finite.
    """
    if scale not in ("row_max", "none"):
        raise ValueError(f"l2 loss option scale={scale!r} must be 'row_max' or 'none'")
    s = teacher_logits(q, k)
    visible, approx = _masks(s.shape[-1], causal, window, s.device)
    log_hat = log_student_kernel(log_q, log_k)
    s, log_hat = s.double(), log_hat.double()  # squares of exponentials: fp64 range
    if scale == "row_max":
        top = s.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True).detach()
        s, log_hat = s - top, log_hat - top
    # a wildly overestimating student must give a huge but finite loss, not inf
    diff = torch.exp(s.clamp_max(300)) - torch.exp(log_hat.clamp_max(300))
    loss = torch.where(approx, diff.pow(2), 0.0).sum(-1).mean()
    return loss.to(q.dtype) if scale == "row_max" else loss
