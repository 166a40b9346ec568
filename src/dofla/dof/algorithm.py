"""Algorithm 1: the statistical degrees of freedom of each layer's attention kernel.

For layer s and head h, J vectors x_1..x_J are sampled from the pooled queries and keys; with the
Gram matrix G of K(x, y) = exp(x·y/sqrt(d)) (normalised by ``gram_norm``), the DoF is
N = tr G(G + λI)⁻¹ = Σ_i μ_i / (μ_i + λ) over G's eigenvalues μ. A layer's value is the max over
its heads (they share one feature dimension). METHOD.md §4 explains ``gram_norm``: ``J`` is the
paper's G/J, which saturates at ≈ J on real post-RoPE activations; ``trace`` (the default)
divides by tr G, making λ relative to the kernel's own size.
"""
from __future__ import annotations

import math

import torch

GRAM_NORMS = ("none", "J", "trace")


def sample_pool(q: torch.Tensor, k: torch.Tensor, head: int, num_samples: int,
                generator: torch.Generator) -> torch.Tensor:
    """(J, d) float64 sample without replacement from head ``head``'s queries and its KV head's keys.

    q (N, H, d), k (N, H_kv, d); GQA: query head h reads KV head h // (H // H_kv).
    """
    group = q.shape[1] // k.shape[1]
    pool = torch.cat([q[:, head], k[:, head // group]], dim=0)
    if pool.shape[0] > num_samples:
        pool = pool[torch.randperm(pool.shape[0], generator=generator)[:num_samples]]
    return pool.to(torch.float64)


def gram_matrix(x: torch.Tensor, gram_norm: str) -> torch.Tensor:
    """(..., J, d) -> (..., J, J) normalised Gram matrix of the attention kernel, in float64."""
    if gram_norm not in GRAM_NORMS:
        raise ValueError(f"gram_norm={gram_norm!r} is not valid; choose one of {', '.join(GRAM_NORMS)}")
    logits = x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])
    if gram_norm == "none":
        return logits.exp()
    if gram_norm == "J":
        return logits.exp() / x.shape[-2]
    # trace: subtract the max before exp (the normalisation cancels it) so nothing overflows
    shifted = (logits - logits.amax(dim=(-1, -2), keepdim=True)).exp()
    return shifted / shifted.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]


def dof_from_eigenvalues(mu: torch.Tensor, lam: float) -> torch.Tensor:
    """Σ μ/(μ+λ) over the last axis (tiny negative eigenvalues from round-off count as 0)."""
    mu = mu.clamp_min(0)
    return (mu / (mu + lam)).sum(-1)


def dof_by_cholesky(gram: torch.Tensor, lam: float) -> torch.Tensor:
    """tr G(G+λI)⁻¹ = J − λ·tr (G+λI)⁻¹, with tr A⁻¹ = ‖L⁻¹‖²_F from A = LLᵀ (batched).

    Several times faster than an eigenvalue solve; G+λI is positive definite (its smallest
    eigenvalue is ≥ λ), so the factorisation is stable in float64.
    """
    j = gram.shape[-1]
    eye = torch.eye(j, dtype=gram.dtype, device=gram.device)
    chol = torch.linalg.cholesky(gram + lam * eye)
    inv_l = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    return j - lam * inv_l.pow(2).sum((-1, -2))


def dof_dense_reference(gram: torch.Tensor, lam: float) -> float:
    """tr G (G + λI)⁻¹ with a linear solve: the plain reference the eigenvalue route must match."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    return float(torch.linalg.solve(gram + lam * eye, gram).diagonal().sum())


def estimate_layer_dof(q: torch.Tensor, k: torch.Tensor, lam: float, num_samples: int,
                       gram_norm: str = "trace", seed: int = 0,
                       method: str = "cholesky") -> tuple[list[float], float]:
    """Per-head DoF and the layer value (max over heads) for one layer's q (N, H, d), k (N, H_kv, d).

    All heads are batched; ``method="cholesky"`` (default) uses the trace identity, ``"eigh"`` the
    eigenvalues (the paper's statement); tests check both against the dense reference.
    """
    if lam <= 0 or num_samples < 1:
        raise ValueError(f"need lambda > 0 and num_samples ≥ 1, got {lam} and {num_samples}")
    generator = torch.Generator().manual_seed(seed)
    x = torch.stack([sample_pool(q, k, h, num_samples, generator) for h in range(q.shape[1])])
    gram = gram_matrix(x, gram_norm)  # (H, J, J)
    if method == "cholesky":
        per_head = dof_by_cholesky(gram, lam).tolist()
    elif method == "eigh":
        per_head = dof_from_eigenvalues(torch.linalg.eigvalsh(gram), lam).tolist()
    else:
        raise ValueError(f"method={method!r} must be 'cholesky' or 'eigh'")
    return per_head, max(per_head)


def check_degenerate(layer_dof: list[float], num_samples: int) -> str | None:
    """A warning sentence when the DoF profile cannot drive an allocation, else None."""
    if not layer_dof:
        return None
    if max(layer_dof) > 0.9 * num_samples:
        return (f"Algorithm 1 is saturated: a layer's DoF ({max(layer_dof):.0f}) exceeds 0.9·J "
                f"(J={num_samples}), so dof allocation degenerates into fix; use "
                "allocation.gram_norm=trace or a larger allocation.lam")
    low, high = min(layer_dof), max(layer_dof)
    if high <= 1.05 * low:
        return (f"all layers have nearly the same DoF ({low:.1f}–{high:.1f}), so dof allocation "
                "equals fix; try another allocation.lam or allocation.gram_norm")
    return None
