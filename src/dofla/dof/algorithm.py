"""Algorithm 1: the statistical degrees of freedom of each layer's attention kernel.

For layer s and head h, J vectors x_1..x_J are sampled from the pooled queries and keys; with the
Gram matrix G of K(x, y) = exp(x·y/sqrt(d)) (normalised by ``gram_norm``), the DoF is
N = tr G(G + λI)⁻¹ = Σ_i μ_i / (μ_i + λ) over G's eigenvalues μ. A layer's value is the max over
its heads (they share one feature dimension). docs/method.md §4 explains ``gram_norm``: ``J`` is the
paper's G/J, which saturates at ≈ J on real post-RoPE activations; ``trace`` (the default)
divides by tr G, making λ relative to the kernel's own size.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch

GRAM_NORMS = ("none", "J", "trace")
# how a layer's value comes from its heads' DoF: the paper's max (heads share one dimension),
# or the mean / median, which vary less between J-samples than a max does
HEAD_AGGREGATES = ("max", "mean", "median")


def sample_pool(q, k, head: int, num_samples: int, generator: torch.Generator) -> torch.Tensor:
    """(J, d) float64 sample without replacement from head ``head``'s queries and its KV head's keys.

    q (N, H, d), k (N', H_kv, d): torch tensors or numpy arrays/memmaps, any float dtype. GQA: query
    head h reads KV head h // (H // H_kv). When the pool holds fewer than J vectors all of them are
    used (in order) and a warning says so; the returned row count is then below J.
    """
    n_q, n_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if n_q + n_k > num_samples:
        index = torch.randperm(n_q + n_k, generator=generator)[:num_samples]
    else:
        index = torch.arange(n_q + n_k)
        warnings.warn(f"only {n_q + n_k} queries and keys for head {head}, fewer than "
                      f"num_samples={num_samples}; using all of them (cache more tokens for a full J)",
                      stacklevel=2)
    # gather only the sampled rows, so a memory-mapped cache is read sparsely, never copied whole;
    # index_select/index_copy_ because advanced indexing costs ~10 ms a call on a busy CPU pool
    from_q = index < n_q
    q_at, k_at = from_q.nonzero().squeeze(1), (~from_q).nonzero().squeeze(1)  # positions in the pool
    pool = torch.empty(len(index), q.shape[-1], dtype=torch.float64)
    pool.index_copy_(0, q_at, _rows(q, head, index.index_select(0, q_at)))
    pool.index_copy_(0, k_at, _rows(k, head // group, index.index_select(0, k_at) - n_q))
    return pool


def _rows(a, head: int, index: torch.Tensor) -> torch.Tensor:
    """(len(index), d) float64 rows ``a[index, head]`` of a tensor or numpy array."""
    if isinstance(a, torch.Tensor):
        return a.select(1, head).index_select(0, index.to(a.device)).to("cpu", torch.float64)
    return torch.from_numpy(np.asarray(a[index.numpy(), head], dtype=np.float64))


def gram_matrix(x: torch.Tensor, gram_norm: str) -> torch.Tensor:
    """(..., J, d) -> (..., J, J) normalised Gram matrix of the attention kernel, in float64."""
    if gram_norm not in GRAM_NORMS:
        raise ValueError(f"gram_norm={gram_norm!r} is not valid; choose one of {', '.join(GRAM_NORMS)}")
    # in place throughout: at (12, 2048, 2048) float64 every temporary is 400 MB of page faults
    logits = (x @ x.transpose(-1, -2)).div_(math.sqrt(x.shape[-1]))
    if gram_norm == "none":
        return logits.exp_()
    if gram_norm == "J":
        return logits.exp_().div_(x.shape[-2])
    # trace: subtract the max before exp (the normalisation cancels it) so nothing overflows
    gram = logits.sub_(logits.amax(dim=(-1, -2), keepdim=True)).exp_()
    return gram.div_(gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None])


def dof_from_eigenvalues(mu: torch.Tensor, lam: float) -> torch.Tensor:
    """Σ μ/(μ+λ) over the last axis (tiny negative eigenvalues from round-off count as 0)."""
    mu = mu.clamp_min(0)
    return (mu / (mu + lam)).sum(-1)


def dof_by_cholesky(gram: torch.Tensor, lam: float) -> torch.Tensor:
    """(..., J, J) -> (...): tr G(G+λI)⁻¹ = J − λ·tr (G+λI)⁻¹, with tr A⁻¹ = ‖L⁻¹‖²_F from A = LLᵀ.

    About 5× faster than an eigenvalue solve on CPU. G+λI is positive definite in exact arithmetic
    (smallest eigenvalue ≥ λ); a head whose factorisation still fails from round-off (huge
    un-normalised kernels) falls back to the eigenvalue route.
    """
    j = gram.shape[-1]
    eye = torch.eye(j, dtype=gram.dtype, device=gram.device)
    shifted = gram.clone()
    shifted.diagonal(dim1=-2, dim2=-1).add_(lam)
    chol, info = torch.linalg.cholesky_ex(shifted)
    del shifted
    inv_l = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    dof = j - lam * torch.linalg.vector_norm(inv_l, dim=(-2, -1)).square()
    failed = info != 0
    if failed.any():
        dof[failed] = dof_from_eigenvalues(torch.linalg.eigvalsh(gram[failed]), lam)
    return dof


def dof_dense_reference(gram: torch.Tensor, lam: float) -> float:
    """tr G (G + λI)⁻¹ with a linear solve: the plain reference the eigenvalue route must match."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    return float(torch.linalg.solve(gram + lam * eye, gram).diagonal().sum())


def estimate_layer_dof(q, k, lam: float, num_samples: int, gram_norm: str = "trace", seed: int = 0,
                       method: str = "cholesky", aggregate: str = "max") -> tuple[list[float], float]:
    """Per-head DoF (H floats) and the layer value (their ``aggregate``, the paper's max) for one layer.

    q (N, H, d), k (N', H_kv, d) as in :func:`sample_pool`. All heads go through one batched
    (H, J, J) solve: ``method="cholesky"`` (default, the trace identity) or ``"eigh"`` (eigvalsh,
    the paper's statement); tests check both against :func:`dof_dense_reference`.
    """
    _check_layer_inputs(q, k, lam, num_samples, gram_norm, method)
    generator = torch.Generator().manual_seed(seed)
    x = torch.stack([sample_pool(q, k, h, num_samples, generator) for h in range(q.shape[1])])
    gram = gram_matrix(x, gram_norm)  # (H, J, J)
    if not torch.isfinite(gram).all():
        top = float((x * x).sum(-1).max() / math.sqrt(x.shape[-1]))
        raise ValueError(f"the kernel overflows float64 with gram_norm={gram_norm!r} (largest "
                         f"|x|²/sqrt(d) is {top:.0f}); use gram_norm='trace', which is overflow-safe")
    if method == "cholesky":
        per_head = dof_by_cholesky(gram, lam).tolist()
    else:
        per_head = dof_from_eigenvalues(torch.linalg.eigvalsh(gram), lam).tolist()
    return per_head, aggregate_heads(per_head, aggregate)


def aggregate_heads(per_head: list[float], aggregate: str = "max") -> float:
    """A layer's DoF from its heads' values."""
    if aggregate not in HEAD_AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} is not valid; choose one of {', '.join(HEAD_AGGREGATES)}")
    values = torch.tensor(per_head, dtype=torch.float64)
    return float({"max": values.max, "mean": values.mean, "median": values.median}[aggregate]())


def estimate_layer_dof_averaged(q, k, lam: float, num_samples: int, gram_norm: str = "trace", seeds=(0,),
                                aggregate: str = "max") -> tuple[list[float], float, list[float]]:
    """Per-head DoF averaged over one J-sample per seed, its layer value, and each sample's layer value.

    One sample (one seed) is :func:`estimate_layer_dof` exactly. The mean of R samples moves about
    1/√R as much between runs as one sample does, so the dims built on it are steadier; heads are
    averaged before the ``aggregate`` (a max over heads of noisy values is biased upwards).
    """
    runs = [estimate_layer_dof(q, k, lam, num_samples, gram_norm, seed, aggregate=aggregate) for seed in seeds]
    per_head = torch.tensor([heads for heads, _ in runs], dtype=torch.float64).mean(0).tolist()
    return per_head, aggregate_heads(per_head, aggregate), [value for _, value in runs]


def layer_dof_spread(q, k, lam: float, num_samples: int, gram_norm: str = "trace", seeds=(0, 1, 2, 3, 4),
                     aggregate: str = "max") -> dict:
    """How much one layer's DoF moves between J-samples: the layer value for each seed's sample.

    Returns {"values": [...], "mean", "std", "rel_spread": (max − min) / mean}; a stable estimate
    has a small relative spread (a dim allocated from it moves by the same fraction).
    """
    values = estimate_layer_dof_averaged(q, k, lam, num_samples, gram_norm, list(seeds), aggregate)[2]
    t = torch.tensor(values, dtype=torch.float64)
    mean = float(t.mean())
    std = float(t.std()) if len(values) > 1 else 0.0
    return {"values": values, "mean": mean, "std": std,
            "rel_spread": float((t.max() - t.min()) / mean) if mean > 0 else 0.0}


def _check_layer_inputs(q, k, lam: float, num_samples: int, gram_norm: str, method: str) -> None:
    if not (lam > 0 and math.isfinite(lam)) or num_samples < 1:
        raise ValueError(f"need lambda > 0 and num_samples ≥ 1, got lambda={lam} and num_samples={num_samples}")
    if gram_norm not in GRAM_NORMS:
        raise ValueError(f"gram_norm={gram_norm!r} is not valid; choose one of {', '.join(GRAM_NORMS)}")
    if method not in ("cholesky", "eigh"):
        raise ValueError(f"method={method!r} is not valid; choose 'cholesky' or 'eigh'")
    if len(q.shape) != 3 or len(k.shape) != 3 or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"need q (N, H, d) and k (N, H_kv, d) with H a multiple of H_kv, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")


def check_degenerate(layer_dof: list[float], num_samples: int) -> str | None:
    """A warning sentence when the DoF profile cannot drive an allocation, else None."""
    if not layer_dof:
        return None
    if max(layer_dof) > 0.9 * num_samples:
        return (f"Algorithm 1 is saturated: a layer's DoF ({max(layer_dof):.0f}) exceeds 0.9·J "
                f"(J={num_samples}), so dof allocation degenerates into fix; use "
                "allocation.gram_norm=trace or a larger allocation.lam")
    low, high = min(layer_dof), max(layer_dof)
    if len(layer_dof) > 1 and high <= 1.05 * low:
        return (f"all layers have nearly the same DoF ({low:.1f}–{high:.1f}), so dof allocation "
                "equals fix; try another allocation.lam or allocation.gram_norm")
    return None
