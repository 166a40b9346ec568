"""Distillation losses (docs/method.md §3): the layerwise ones, computed stably in log space, in the
registry; and the next-token loss the direct training mode (``loss=direct``, :mod:`dofla.stages.plan`)
trains the whole student on.

The layerwise losses take log features log_q, log_k (B, H, L, M), teacher q, k (B, H, L, d) (k expanded to H
heads, q scaled so the kernel is exp(q·k/sqrt(d))), and return a scalar averaged over query rows.
A loss with ``needs_values = True`` (``output``) also takes the teacher's values v (B, H, L, dv).
``window > 0`` trains a hybrid layer: keys i−W < j ≤ i are exact softmax, only older keys use K̂
(``sinks`` > 0: the first ``sinks`` keys are exact too). Options ``softcap`` (Gemma 2) cap the
teacher's logits. Student kernels use a causal row scale (:mod:`dofla.attention.stable`).
"""
from __future__ import annotations

import functools
import math

import torch

from dofla.attention.hybrid import exact_logits
from dofla.attention.stable import causal_log_kernel, widened
from dofla.registry import Registry
from dofla.train import causal_losses
from dofla.train.causal_losses import check_softcap

LOSSES: Registry = Registry("loss")


def shifted_student_kernel(log_q: torch.Tensor, log_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S (B, H, L, L) and r (B, H, L, 1) with K̂_ij = e^{r_i} S_ij, computed without overflow.

    With c_m = max_j log_k[j, m] and r_i = max_m(log_q[i, m] + c_m) (both detached, so they are
    constants of the graph), S_ij = Σ_m exp(log_q + c − r)_im exp(log_k − c)_jm ≤ M.
    """
    fq, fk, r = shifted_features(log_q, log_k, with_shift=True)
    return widened(fq @ fk.transpose(-1, -2)), r


def shifted_features(log_q: torch.Tensor, log_k: torch.Tensor, with_shift: bool = False):
    """exp(log_q + c − r), exp(log_k − c) (each entry ≤ 1; S = their product), and r if asked."""
    c = log_k.detach().amax(dim=2, keepdim=True)
    u = log_q + c
    r = u.detach().amax(dim=-1, keepdim=True)
    fq, fk = torch.exp(u - r), torch.exp(log_k - c)
    return (fq, fk, r) if with_shift else (fq, fk)


# log K̂ is floored at e^{-F} of the row's largest term: log(s + e^{-F}). The backward of a stabilised
# kernel multiplies 1/(s + e^{-F}) by query factors up to e^G (attention.stable.guard) and sums over
# keys, so F + G + log(keys) must stay inside the dtype's range: at real norms (|k| ~ 160, head dim
# 256) a floor at the smallest normal number overflowed there and the features' gradient was NaN.
LOG_FLOOR = {torch.float64: math.exp(-300.0), torch.float32: math.exp(-20.0)}


def _log_floor(s: torch.Tensor) -> torch.Tensor:
    """log(s + e^{-F}) for scores relative to the row's largest term: an entry the student all but
    misses costs at most F nats and keeps a (small) gradient; the rest is log s to within e^{-F}/s."""
    return torch.log(s + LOG_FLOOR.get(s.dtype, LOG_FLOOR[torch.float32]))


def log_student_kernel(log_q: torch.Tensor, log_k: torch.Tensor) -> torch.Tensor:
    """(B, H, L, L) log K̂_ij = log Φ(q_i)·Φ(k_j) for every pair (no mask; shifts over all keys).
    The losses use the causal form, :func:`dofla.attention.causal_log_kernel`."""
    s, r = shifted_student_kernel(log_q, log_k)
    return r + torch.log(s.clamp_min(torch.finfo(s.dtype).tiny))  # exact down to the smallest normal


def teacher_logits(q: torch.Tensor, k: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """(B, H, L, L) q·k/sqrt(d); with ``softcap`` (Gemma 2) softcap·tanh(logits/softcap)."""
    check_softcap(softcap)
    return exact_logits(q, k, softcap)


def _masks(length: int, causal: bool, window: int, device, sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, approximated): which (i, j) the row sees, and which of those use K̂ (older than
    the window and not one of the first ``sinks`` tokens)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    visible = j <= i if causal else torch.ones(length, length, dtype=torch.bool, device=device)
    approximated = visible & (j <= i - window) & (j >= sinks) if window > 0 else visible
    return visible, approximated


def _student(log_q, log_k, causal: bool, window: int, sinks: int = 0):
    """(log K̂ (B, H, L, L), log Σ_visible K̂ (B, H, L, 1)) with a causal row scale: row i's shift
    depends only on the keys it sees (j ≤ i − window), sink keys excluded from K̂."""
    if not causal:
        log_kernel = log_student_kernel(log_q, log_k)
        return log_kernel, torch.logsumexp(log_kernel, -1, keepdim=True)
    if sinks > 0 and window > 0:
        is_sink = torch.arange(log_k.shape[2], device=log_k.device) < sinks
        log_k = log_k.masked_fill(is_sink[:, None], float("-inf"))
    return causal_log_kernel(log_q, log_k, lag=window)


def _check_sinks(window: int, sinks: int) -> None:
    if sinks < 0 or (sinks > 0 and window <= 0):
        raise ValueError(
            f"loss option sinks={sinks!r} needs window > 0 and sinks ≥ 0 (sinks are exact keys of a hybrid layer)"
        )


@LOSSES.register("softmax")
def softmax_loss(log_q, log_k, q, k, causal: bool = True, window: int = 0, *, sinks: int = 0,
                 softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy from the teacher's attention distribution p to the student's p̂ (the paper's).

    Without a window CE_i = log Σ_{j≤i} K̂_ij − Σ_j p_ij log K̂_ij, with K̂ from the causal
    stabiliser (a row's scale uses only keys it sees, so a huge later key cannot zero a row's loss
    or gradient) and its normaliser from per-block row sums: no (L, L) log-softmax. The teacher's
    p is built on the same pieces of rows and keys (:mod:`dofla.train.causal_losses`): neither side ever
    forms the whole (L, L) matrix, and the keys a row cannot see are never computed. A hybrid
    layer's exact keys join both sums with the teacher's logits.
    """
    _check_sinks(window, sinks)
    if causal:
        return causal_losses.cross_entropy(log_q, log_k, q, k, softcap, _log_floor, window, sinks)
    return softmax_dense(log_q, log_k, q, k, causal, window, sinks, softcap)


def softmax_dense(log_q, log_k, q, k, causal, window, sinks=0, softcap=None) -> torch.Tensor:
    """:func:`softmax_loss` on (L, L) matrices: non-causal layers, and the pieces' reference."""
    if window > 0:
        return _hybrid_softmax_loss(log_q, log_k, q, k, causal, window, sinks, softcap)
    p = torch.softmax(teacher_logits(q, k, softcap), dim=-1)
    log_kernel, log_norm = _student(log_q, log_k, causal, window)
    return (log_norm.squeeze(-1) - (p * log_kernel).sum(-1)).mean()


def _hybrid_student(log_q, log_k, s, causal, window, sinks):
    """(B, H, L, L) student log scores of a hybrid layer (exact in window/sinks, log K̂ elsewhere,
    −inf on hidden keys) and the visible mask."""
    visible, approx = _masks(s.shape[-1], causal, window, s.device, sinks)
    log_kernel, _ = _student(log_q, log_k, causal, window, sinks)
    return torch.where(approx, log_kernel, s).masked_fill(~visible, float("-inf")), visible


def _hybrid_softmax_loss(log_q, log_k, q, k, causal, window, sinks, softcap) -> torch.Tensor:
    """The softmax loss when the last ``window`` keys (and the first ``sinks``) are exact: both
    kernels need their true scale."""
    s = teacher_logits(q, k, softcap)
    student, visible = _hybrid_student(log_q, log_k, s, causal, window, sinks)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    log_p_hat = torch.log_softmax(student, dim=-1).masked_fill(~visible, 0.0)
    return -(p * log_p_hat).sum(-1).mean()


@LOSSES.register("l2")
def l2_loss(log_q, log_k, q, k, causal: bool = True, window: int = 0, scale: str = "row_max", *,
            sinks: int = 0, softcap: float | None = None) -> torch.Tensor:
    """Squared error between teacher and student attention, mean over query rows (and heads).

    ``scale`` picks what is compared, K_ij = exp(q_i·k_j/sqrt(d)) the teacher kernel:
      - ``"none"``: the paper's form, Σ_j (K_ij − K̂_ij)² over the approximated pairs, averaged
        over query rows; it differs from the paper only by the causal mask and the mean over heads.
        Computed and returned in float64 (K reaches e^70 at real norms, beyond fp32 when squared);
        its gradient can still overflow fp32 features (the trainer reports that as non-finite).
      - ``"row_max"``: the same with both kernels of row i divided by the teacher's max_j K_ij.
      - ``"rows"``: Σ_j (p_ij − p̂_ij)² between the normalised attention rows, each normalised over
        the keys it sees (p̂ includes the exact window/sink part of a hybrid layer). Bounded by 2
        per row; this one trains on real models.

    A causal layer computes every form on the causal pieces (:mod:`dofla.train.causal_losses`);
    the (L, L) form below is their reference and the non-causal layers'.
    """
    if scale not in ("row_max", "none", "rows"):
        raise ValueError(f"l2 loss option scale={scale!r} must be 'row_max', 'none' or 'rows'")
    _check_sinks(window, sinks)
    if causal:
        if scale == "rows":
            return causal_losses.l2_rows(log_q, log_k, q, k, softcap, window, sinks)
        limit = ROW_MAX_LIMIT if scale == "row_max" else 300.0
        loss = causal_losses.l2_kernel(log_q, log_k, q, k, scale, softcap, limit, _saturating_exp, window, sinks)
        return loss.to(q.dtype) if scale == "row_max" else loss
    return l2_dense(log_q, log_k, q, k, causal, window, scale, sinks, softcap)


def l2_dense(log_q, log_k, q, k, causal, window, scale, sinks=0, softcap=None) -> torch.Tensor:
    """:func:`l2_loss` on (L, L) matrices: non-causal layers, and the pieces' reference."""
    s = teacher_logits(q, k, softcap)
    if scale == "rows":
        return _l2_rows(log_q, log_k, s, causal, window, sinks)
    visible, approx = _masks(s.shape[-1], causal, window, s.device, sinks)
    log_hat, _ = _student(log_q, log_k, causal, window, sinks)
    s, log_hat = s.double(), log_hat.double()  # squares of exponentials: fp64 range
    if scale == "row_max":
        top = s.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True).detach()
        s, log_hat = s - top, log_hat - top
    # a wildly overestimating student must give a huge but finite loss, not inf, and keep a gradient
    limit = ROW_MAX_LIMIT if scale == "row_max" else 300.0
    diff = torch.exp(s.clamp_max(limit)) - _saturating_exp(log_hat, limit)
    loss = torch.where(approx, diff.pow(2), 0.0).sum(-1).mean()
    return loss.to(q.dtype) if scale == "row_max" else loss


# Under row_max scaling the teacher's entries are ≤ 1; a student entry above e^30 of the row's top is
# continued linearly so the squared error (summed over keys) still fits the fp32 loss it returns.
ROW_MAX_LIMIT = 30.0


def _saturating_exp(x: torch.Tensor, limit: float) -> torch.Tensor:
    """exp(x) up to e^limit, its tangent line above: large and finite, with a non-zero gradient."""
    top = math.exp(limit)
    return torch.where(x > limit, top * (1.0 + (x - limit)), torch.exp(x.clamp_max(limit)))


def _attention_rows(log_q, log_k, s, causal, window, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, p̂) (B, H, L, L): teacher and student attention rows, each normalised over the keys the
    row sees (a hybrid's p̂ includes its exact window/sink part), 0 on hidden keys."""
    if window > 0:
        student, visible = _hybrid_student(log_q, log_k, s, causal, window, sinks)
        p_hat = torch.softmax(student, dim=-1)
    else:
        visible, _ = _masks(s.shape[-1], causal, window, s.device)
        log_kernel, log_norm = _student(log_q, log_k, causal, window)
        p_hat = torch.exp(log_kernel - log_norm).masked_fill(~visible, 0.0)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1), p_hat


def _l2_rows(log_q, log_k, s, causal, window, sinks) -> torch.Tensor:
    """Σ_j (p_ij − p̂_ij)² per row, mean over rows."""
    p, p_hat = _attention_rows(log_q, log_k, s, causal, window, sinks)
    return (p - p_hat).pow(2).sum(-1).mean()


@LOSSES.register("output")
def output_loss(log_q, log_k, q, k, causal: bool = True, window: int = 0, *, v: torch.Tensor | None = None,
                sinks: int = 0, softcap: float | None = None, student=None) -> torch.Tensor:
    """Relative squared error of the attention output, Σ‖y − ŷ‖² / Σ‖y‖² over the batch (LoLCATs'
    attention-transfer MSE, scaled so layers compare; its square root is the attention error).

    y = softmax(s) v is the teacher's output, ŷ = p̂ v the student's with p̂ its normalised
    attention rows (for a hybrid layer the exact window/sink part included). Unlike the
    cross-entropy of ``softmax``, which must put mass on every key the teacher attends to, it
    rewards the student's rows only through what they change in the output: a hybrid's linear part
    learns to stay small where the window already carries the output. A causal layer's ŷ comes
    from its own chunked kernel and y from fused attention (:mod:`dofla.train.causal_losses`).
    ``student``: a gated-delta layer's :class:`~dofla.attention.delta_gates.DeltaFeatureMap`, whose
    own attention (delta rule, gates, normalisation) gives ŷ; causal only.
    """
    if v is None:
        raise ValueError("loss 'output' compares attention outputs and needs the teacher's values v")
    _check_sinks(window, sinks)
    if causal or student is not None:
        return causal_losses.output_error(log_q, log_k, q, k, v, window, sinks, softcap, student)
    return output_dense(log_q, log_k, q, k, v, causal, window, sinks, softcap)


def output_dense(log_q, log_k, q, k, v, causal, window, sinks=0, softcap=None) -> torch.Tensor:
    """:func:`output_loss` from the (L, L) attention rows: non-causal layers, and the reference."""
    p, p_hat = _attention_rows(log_q, log_k, teacher_logits(q, k, softcap), causal, window, sinks)
    y = widened(p @ v)
    return (widened(p_hat @ v) - y).pow(2).sum() / y.pow(2).sum().clamp_min(torch.finfo(y.dtype).tiny)


output_loss.needs_values = True
# a ratio of sums over the whole batch, not a mean of per-sequence terms: micro-batches cannot add up
# to it (train.micro_batch_size is refused with this loss)
output_loss.mean_over_rows = False


def next_token_loss(student, input_ids: torch.Tensor) -> torch.Tensor:
    """The whole student's next-token cross-entropy (mean over predicted tokens): the direct training
    mode's objective, every layer's features train through it at once
    (:func:`dofla.train.direct.train_direct`). Not in :data:`LOSSES`, which holds layer losses."""
    return student(input_ids=input_ids, labels=input_ids, use_cache=False).loss


@functools.cache
def compiled_loss(name: str):
    """Layer loss ``name`` under ``torch.compile`` (``train.compile``): one compiled function for every
    layer (it takes tensors, not the feature map); a new input shape compiles once more. While
    compiling, the stabiliser decides every block's fast path up front, so the graph breaks once per
    call rather than once per block."""
    return torch.compile(LOSSES.get(name))


def end_to_end(loss: str) -> bool:
    """Whether ``loss.name`` names the direct training mode (the whole student at once) rather than a
    layer loss; a run reads its mode from its plan (:class:`dofla.stages.plan.TrainPlan`)."""
    return loss == "direct"


def layerwise_losses() -> list[str]:
    """The registered losses: each trains one layer at a time."""
    return LOSSES.names()
