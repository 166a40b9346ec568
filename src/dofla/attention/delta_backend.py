"""Which kernel runs the gated delta rule: flash-linear-attention's Triton kernel on a GPU when it is
installed and the inputs are half precision, else the PyTorch chunked form; one token against a
state runs the recurrent step.

``flash-linear-attention`` (``pip install 'dofla[fla]'``) is optional: its ``chunk_gated_delta_rule``
computes the same recurrence (:mod:`dofla.attention.delta`), in the layout (B, T, H, ·), in the inputs'
own dtype (fp32 too, since fla 0.4); ``auto`` sends it the half-precision forwards (``precision=bf16``) on
CUDA, and ``backend='fla'`` any dtype. The parity test against
the PyTorch form is marked ``gpu``; it has not run on the machines this code was developed on.

Layouts as in :mod:`dofla.attention.delta`: q, k (B, H, T, M); v (B, H, T, dv); log_alpha, beta (B, H, T).
"""
from __future__ import annotations

import functools

import torch

from dofla.attention.delta import (LOG_ALPHA_MIN, DeltaState, delta_rule_chunked, delta_rule_recurrent)

BACKENDS = ("auto", "torch", "fla")
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def fla_kernel():
    """fla's ``chunk_gated_delta_rule``, or None when it is not installed. Imported lazily, on the first
    GPU call only: the package pulls in Triton and compiles CUDA kernels, which a CPU run must never
    need (or pay for at import time)."""
    try:
        # lazy: flash-linear-attention is an optional GPU extra
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or installed without a working Triton/CUDA
        return None
    return chunk_gated_delta_rule


def use_fla(v: torch.Tensor, backend: str = "auto") -> bool:
    """Whether this call goes to fla: asked for, or (``auto``) on CUDA with half-precision inputs
    and fla importable."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    if backend == "fla":
        if fla_kernel() is None:
            raise RuntimeError("backend='fla' needs flash-linear-attention: pip install 'dofla[fla]' (CUDA only)")
        return True
    return v.is_cuda and v.dtype in HALF and fla_kernel() is not None


def delta_rule_fla(q, k, v, log_alpha, beta, state: DeltaState | None = None, *,
                   key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, DeltaState]:
    """The chunked form through fla's kernel: q, k, v and β in v's dtype (fp32 passes through as fp32), the
    decay and the state in fp32. Padding as in the PyTorch forms (β = 0, log α = 0, k = v = 0 at pads)."""
    dtype, t = v.dtype, v.shape[2]
    log_alpha = log_alpha.float().clamp_min(LOG_ALPHA_MIN)
    beta = beta.float()
    if key_valid is not None:
        pad = ~key_valid.to(torch.bool)[:, None, :]
        beta, log_alpha = beta.masked_fill(pad, 0.0), log_alpha.masked_fill(pad, 0.0)
        k, v = k.masked_fill(pad[..., None], 0.0), v.masked_fill(pad[..., None], 0.0)
    time_major = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  (B, H, T, ·) -> (B, T, H, ·)
    initial = None if state is None else state.S.float().contiguous()
    out, final = fla_kernel()(time_major(q.to(dtype)), time_major(k.to(dtype)), time_major(v.to(dtype)),
                              time_major(log_alpha), time_major(beta.to(dtype)), scale=1.0,
                              initial_state=initial, output_final_state=True)
    return out.transpose(1, 2).to(v.dtype), DeltaState(final, (0 if state is None else state.length) + t)


def delta_rule(q, k, v, log_alpha, beta, chunk_size: int = 64, state: DeltaState | None = None, *,
               key_valid: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, DeltaState]:
    """The gated delta rule by the fastest form available (module docstring); same contract as
    :func:`dofla.attention.delta.delta_rule_chunked`."""
    if state is not None and q.shape[2] == 1 and backend != "fla":
        return delta_rule_recurrent(q, k, v, log_alpha, beta, state, key_valid=key_valid)
    if use_fla(v, backend):
        return delta_rule_fla(q, k, v, log_alpha, beta, state, key_valid=key_valid)
    return delta_rule_chunked(q, k, v, log_alpha, beta, chunk_size, state, key_valid=key_valid)
