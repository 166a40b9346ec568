"""The teacher's next-token distributions as the distill stage's targets, and the KL to them.

Two formats (``distill.teacher_topk``):

- exact (0): the teacher's logits over the whole vocabulary; the loss is
  T² · KL(softmax(t / T) ‖ softmax(z / T)), the mean over tokens.
- top-k (k > 0): the log-probabilities at temperature T of the teacher's k most likely tokens, their
  ids, and the log of the mass on all the others ("the rest"). The loss is the KL over k + 1 buckets,
  the k tokens and the rest, with the student's probabilities gathered into the same buckets. It is
  at most the exact KL (merging outcomes never increases a KL); its gradient for a token j outside
  the top k is q_j · (1 − p_rest / q_rest) instead of q_j − p_j: the teacher's rest is taken to be
  spread as the student spreads it. A few bytes per position instead of the vocabulary's logits, so
  a text's targets can be stored (:mod:`dofla.cache.teacher_logits`).

Both losses are autograd functions that keep only the student's logits and the teacher's
probabilities for the backward, whose gradient is written in one pass ((q − p) / T per logit): the
composed form (``kl_to_teacher``) holds two log-softmaxes, their difference and its gradients, each
a (positions, vocabulary) float32 tensor. The plain forms beside them are what the tests compare
(``dofla.train.distill.kl_reference``, :func:`topk_kl_reference`).

Logits are (..., V); the arithmetic is float32, or float64 for float64 logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dofla.errors import ConfigError


def _dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _scaled(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """``logits / T`` in ``dtype`` (no copy when nothing changes)."""
    x = logits.to(dtype)
    return x if temperature == 1.0 else x / temperature


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a·b over the last dimension, without an (..., V) product tensor."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


class _ExactKL(torch.autograd.Function):
    """Per-token KL(p ‖ softmax(z / T)) given p and the teacher's Σ p log p (``negentropy``)."""

    @staticmethod
    def forward(ctx, z, p, negentropy, temperature):
        zl = _scaled(z, temperature, p.dtype)
        lse = torch.logsumexp(zl, dim=-1)
        ctx.save_for_backward(z, p, lse)
        ctx.temperature = temperature
        return negentropy + lse - _dot(p, zl)

    @staticmethod
    def backward(ctx, grad):
        z, p, lse = ctx.saved_tensors
        g = _scaled(z, ctx.temperature, p.dtype).sub(lse.unsqueeze(-1)).exp_().sub_(p)  # q − p
        g.mul_((grad / ctx.temperature).unsqueeze(-1))
        return g.to(z.dtype), None, None, None


def exact_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of T² · KL(softmax(teacher / T) ‖ softmax(student / T)): ``kl_to_teacher``'s
    value and gradient, with a one-pass backward (the gradient reaches the student only)."""
    return ExactTargets(teacher_logits).prepared(temperature, student_logits.dtype).kl(student_logits, temperature)


@dataclass
class TeacherDistribution:
    """The teacher's probabilities at temperature T (B, L, V) and Σ p log p per position (B, L): what
    the exact KL and its gradient need, without the logits they came from."""

    p: torch.Tensor
    negentropy: torch.Tensor
    temperature: float

    def prepared(self, temperature: float, dtype=torch.float32) -> TeacherDistribution:
        return self

    def kl(self, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        if temperature != self.temperature:
            raise ValueError(f"the teacher's distribution was made at temperature {self.temperature}, not {temperature}")
        return _ExactKL.apply(student_logits, self.p, self.negentropy, temperature).mean() * temperature**2


class _TopKKL(torch.autograd.Function):
    """Per-token KL over the k + 1 buckets (the teacher's top k, the rest)."""

    @staticmethod
    def forward(ctx, z, ids, log_p, log_rest, temperature):
        zl = _scaled(z, temperature, log_p.dtype)
        lse = torch.logsumexp(zl, dim=-1)
        lse_rest = torch.logsumexp(zl.scatter(-1, ids, float("-inf")), dim=-1)
        log_q = zl.gather(-1, ids) - lse.unsqueeze(-1)
        log_q_rest = lse_rest - lse
        p = log_p.exp()
        rest = torch.where(torch.isinf(log_rest), 0.0, log_rest.exp() * (log_rest - log_q_rest))
        ctx.save_for_backward(z, ids, p, log_q, lse, log_rest - log_q_rest)
        ctx.temperature = temperature
        return (p * (log_p - log_q)).sum(-1) + rest

    @staticmethod
    def backward(ctx, grad):
        z, ids, p, log_q, lse, log_ratio = ctx.saved_tensors
        g = _scaled(z, ctx.temperature, p.dtype).sub(lse.unsqueeze(-1)).exp_()  # q
        g.mul_((1 - log_ratio.exp()).unsqueeze(-1))  # the rest: q_j (1 − p_rest / q_rest)
        g.scatter_(-1, ids, log_q.exp() - p)  # the top k: q_j − p_j
        g.mul_((grad / ctx.temperature).unsqueeze(-1))
        return g.to(z.dtype), None, None, None, None


@dataclass
class ExactTargets:
    """The teacher's logits (B, L, V), in the dtype its forward gave them."""

    logits: torch.Tensor

    def part(self, positions: slice) -> ExactTargets:
        return ExactTargets(self.logits[:, positions])

    @torch.no_grad()
    def prepared(self, temperature: float, dtype=torch.float32) -> TeacherDistribution:
        """The distribution the loss needs, in float32 (or float64 for ``dtype`` or logits in float64):
        made before the student runs, so the logits need not stay alive beside the student's."""
        dtype = torch.promote_types(_dtype(self.logits), dtype)
        tl = _scaled(self.logits, temperature, dtype)
        lse = torch.logsumexp(tl, dim=-1)
        p = (tl - lse.unsqueeze(-1)).exp_()
        return TeacherDistribution(p, _dot(p, tl) - lse, temperature)

    def kl(self, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.prepared(temperature, student_logits.dtype).kl(student_logits, temperature)


@dataclass
class TopKTargets:
    """The teacher's top k at temperature T: ``log_probs`` (B, L, k) and ``ids`` (B, L, k), most likely
    first; ``log_rest`` (B, L): the log of the mass on every other token."""

    log_probs: torch.Tensor
    ids: torch.Tensor
    log_rest: torch.Tensor
    FIELDS = ("log_probs", "ids", "log_rest")

    def part(self, positions: slice) -> TopKTargets:
        return TopKTargets(self.log_probs[:, positions], self.ids[:, positions], self.log_rest[:, positions])

    def prepared(self, temperature: float, dtype=torch.float32) -> TopKTargets:
        return self

    def kl(self, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Mean over tokens of T² · the (k + 1)-bucket KL (module docstring)."""
        per_token = _TopKKL.apply(student_logits, self.ids.long(), self.log_probs, self.log_rest, temperature)
        return per_token.mean() * temperature**2


@dataclass
class HeadTargets:
    """The teacher's final hidden states (B, L, D) and its LM head: the exact logits made a part of
    the positions at a time (``distill.logit_chunk``), never all at once."""

    hidden: torch.Tensor
    head: object

    def part(self, positions: slice) -> ExactTargets:
        return ExactTargets(self.head(self.hidden[:, positions]))

    def prepared(self, temperature: float, dtype=torch.float32) -> HeadTargets:
        return self


Targets = ExactTargets | TopKTargets | HeadTargets | TeacherDistribution


def topk_targets(logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopKTargets:
    """The top-k targets of the teacher's ``logits`` (B, L, V) at temperature T."""
    if not 0 < k < logits.shape[-1]:
        raise ConfigError(f"distill.teacher_topk={k} must be between 1 and the vocabulary size less one "
                          f"({logits.shape[-1] - 1}); 0 keeps the whole distribution")
    log_p = torch.log_softmax(_scaled(logits, temperature, _dtype(logits)), dim=-1)
    top, ids = log_p.topk(k, dim=-1)
    rest = torch.logsumexp(log_p.scatter_(-1, ids, float("-inf")), dim=-1)
    return TopKTargets(top, ids.to(torch.int32), rest)


def topk_kl_reference(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """The (k + 1)-bucket KL written out in float64: both distributions' top-k probabilities (the
    teacher's top k) and one minus their sum, through ``torch.nn.functional.kl_div``."""
    V = teacher_logits.shape[-1]
    p = torch.softmax(teacher_logits.double().reshape(-1, V) / temperature, dim=-1)
    q = torch.softmax(student_logits.double().reshape(-1, V) / temperature, dim=-1)
    ids = p.topk(k, dim=-1).indices
    p_top, q_top = p.gather(-1, ids), q.gather(-1, ids)
    p_buckets = torch.cat([p_top, 1 - p_top.sum(-1, keepdim=True)], dim=-1)
    q_buckets = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=-1)
    return nn.functional.kl_div(q_buckets.log(), p_buckets, reduction="batchmean") * temperature**2
