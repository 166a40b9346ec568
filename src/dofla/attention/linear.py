"""Linear attention in O(T·M·dv): a chunked parallel form and a token-by-token recurrence.

Both keep a per-head state of fixed size: kv (M, dv) = Σ_j exp(log_k_j − c) v_jᵀ and
k_sum (M,) = Σ_j exp(log_k_j − c), with c (M,) the running per-feature maximum of the key log
features. Working relative to c keeps every key feature ≤ 1 (no overflow at PRF norms where
|x|²/sqrt(d) ≈ 140); each query row is shifted by r_i, its largest single term over the keys it
can see, which cancels in numerator/denominator. The chunked form gets r_i and the in-chunk
scores from the causal stabiliser (:mod:`dofla.attention.stable`), so a huge later key in the
same chunk cannot underflow earlier rows. c and the shifts are detached: the output does not
depend on them, so gradients are exact.

A gate (``log_decay`` a_t ≤ 0 per head and token, (B, H, T)) decays the state before each new
key: S_t = e^{a_t} S_{t−1} + φ(k_t) v_tᵀ, so key j reaches query i with weight e^{A_i − A_j}
(A the cumulative sum of a). Inside a chunk that is the ungated kernel on log_q + A_i and
log_k − A_j, with A counted from the chunk's start (bounded by the chunk, so no precision is lost
over long sequences); the carried state's decay moves its offset (a detached shift) and a factor
exp(x − x.detach()) (value 1) carries the decay's gradient.

Layouts: log_q, log_k (B, H, T, M); v (B, H, T, dv); outputs (B, H, T, dv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dofla.attention import groups
from dofla.attention.groups import carry_decay, chunk_group
from dofla.attention.stable import decide_ahead, fast_path_flags, stable_block


@dataclass
class LinearState:
    """Recurrent state after ``length`` tokens. kv (B, H, M, dv), k_sum (B, H, M), offset (B, H, M).

    ``offset`` starts at the dtype's most negative finite value (not −inf) so that rescaling an
    empty state is exp(−huge) = 0 instead of NaN.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    offset: torch.Tensor
    length: int = 0

    @classmethod
    def zeros(
        cls, batch: int, heads: int, features: int, value_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> "LinearState":
        kv = torch.zeros(batch, heads, features, value_dim, dtype=dtype, device=device)
        k_sum = torch.zeros(batch, heads, features, dtype=dtype, device=device)
        offset = torch.full_like(k_sum, torch.finfo(dtype).min)
        return cls(kv, k_sum, offset, 0)

    def to(self, dtype: torch.dtype) -> "LinearState":
        if self.kv.dtype == dtype:
            return self
        return LinearState(self.kv.to(dtype), self.k_sum.to(dtype), self.offset.to(dtype), self.length)

    def detach(self) -> "LinearState":
        return LinearState(self.kv.detach(), self.k_sum.detach(), self.offset, self.length)

    def index_select(self, index: torch.Tensor) -> "LinearState":
        """Reorder/select batch rows (beam search)."""
        index = index.to(self.kv.device)
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return LinearState(pick(self.kv), pick(self.k_sum), pick(self.offset), self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.k_sum, self.offset))


def _prepare(log_q, log_k, v, state, key_valid=None, log_decay=None):
    """Check shapes, pick the compute dtype (≥ fp32: exp of shifted logs needs the mantissa),
    mask padding keys (log_k = −inf, v = 0: they contribute nothing; a pad does not decay the
    state) and create an empty state. Returns (log_q, log_k, v, state, log_decay)."""
    if log_q.shape != log_k.shape or log_k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"expected log_q, log_k (B, H, T, M) and v (B, H, T, dv); got {tuple(log_q.shape)}, "
            f"{tuple(log_k.shape)}, {tuple(v.shape)}"
        )
    if log_decay is not None and log_decay.shape != log_k.shape[:3]:
        raise ValueError(f"log_decay must be (B, H, T) = {tuple(log_k.shape[:3])}; got {tuple(log_decay.shape)}")
    dtype = torch.promote_types(torch.promote_types(log_q.dtype, v.dtype), torch.float32)
    b, h, t, m = log_k.shape
    if state is None:
        state = LinearState.zeros(b, h, m, v.shape[-1], dtype, v.device)
    log_q, log_k, v = log_q.to(dtype), log_k.to(dtype), v.to(dtype)
    if key_valid is not None:
        if key_valid.shape != (b, t):
            raise ValueError(
                f"key_valid must be (B, T) = {(b, t)} bool for the new tokens; got {tuple(key_valid.shape)}"
            )
        pad = ~key_valid.to(torch.bool)[:, None, :, None]
        log_k, v = log_k.masked_fill(pad, float("-inf")), v.masked_fill(pad, 0.0)
        if log_decay is not None:
            log_decay = log_decay.masked_fill(pad[..., 0], 0.0)
    if log_decay is not None:
        log_decay = log_decay.to(dtype)
    return log_q, log_k, v, state.to(dtype), log_decay


def _advance(state: LinearState, key_max: torch.Tensor):
    """New offset max(c, key_max) (detached) and the factor exp(c_old − c_new) for the old sums."""
    offset = torch.maximum(state.offset, key_max).detach()
    return offset, torch.exp(state.offset - offset)


def _query_features(log_q: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """exp(log_q + c − max_m(log_q + c)): ≤ 1, and the largest query·key term is exactly 1."""
    u = log_q + offset
    shift = u.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(u.dtype).min)
    return torch.exp(u - shift)


def _causal_mask(size: int, like: torch.Tensor) -> torch.Tensor:
    """(size, size) lower-triangular ones (diagonal included) in ``like``'s dtype and device."""
    return torch.ones(size, size, dtype=like.dtype, device=like.device).tril_()


def chunk_step(log_q, log_k, vals, kv1, offset, limit, mask=None, first_sees=None, fast=None):
    """One chunk against a carried state: (total, row_scale, kv1', offset').

    log_q (B, H, C, M); log_k (B, H, n, M) and vals (B, H, n, e) the chunk's keys; kv1 (B, H, M, e)
    the state at ``offset`` (B, H, M); row i also sees the chunk keys j < limit[i]. total
    (B, H, C, e) = Σ_visible K̂_ij vals_j · e^{−r_i}; kv1', offset' include all n chunk keys.
    first_sees, fast: as in :func:`dofla.attention.stable.stable_block`.
    """
    blk = stable_block(log_q, log_k, limit, offset, mask, first_sees, fast)
    rescaled = kv1 * torch.exp(offset - blk.offset)[..., None]
    if blk.direct:
        total = blk.query @ rescaled + blk.scores @ vals
    else:  # a feature jumped inside the chunk: read the state at its own offset
        total = torch.exp(log_q + offset[:, :, None] - blk.row_scale) @ kv1 + blk.scores @ vals
    return total, blk.row_scale, rescaled + blk.keys.transpose(-1, -2) @ vals, blk.offset


def _chunk_decay(log_decay: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, T, 1): the gate's cumulative log decay counted from each chunk's start."""
    b, h, t = log_decay.shape
    padded = torch.nn.functional.pad(log_decay, (0, -t % chunk))
    return padded.view(b, h, -1, chunk).cumsum(-1).view(b, h, -1)[:, :, :t, None]


def _chunk_flags(log_q, log_k, decay, offset, chunk: int) -> list[bool]:
    """The stabiliser's fast-path decision for every chunk of the chunked kernel, with one host
    synchronisation: the offset each chunk starts from is the carried state's, advanced chunk by
    chunk (a running maximum of the chunks' key maxima; with the gate, a max-plus scan of them and
    the chunks' total decays), computed for all chunks at once."""
    lq, lk = log_q.detach(), log_k.detach()
    if decay is not None:
        lq, lk = lq + decay, lk - decay
    b, h, t, m = lk.shape
    n = -(-t // chunk)
    padded = torch.nn.functional.pad(lk, (0, 0, 0, n * chunk - t), value=float("-inf"))
    key_max = padded.view(b, h, n, chunk, m).amax(3)  # (B, H, N, M)
    start = offset.detach()[:, :, None]
    if decay is None:  # floor_c = max(offset, key maxima of chunks < c)
        floors = torch.cat([start, key_max[:, :, :-1]], 2).cummax(2).values
    else:  # floor_{c+1} = max(floor_c, key_max_c) + D_c, D_c the chunk's total decay
        total = torch.nn.functional.pad(decay[..., 0], (0, n * chunk - t)).view(b, h, n, chunk)[..., -1]
        before = torch.nn.functional.pad(total.cumsum(2)[:, :, :-1], (1, 0))[..., None]  # P_c = Σ_{i<c} D_i
        best = torch.cat([start, (key_max - before)[:, :, :-1]], 2).cummax(2).values
        floors = before + best
    return fast_path_flags(lq, lk, chunk, floor=floors)


def linear_attention_chunked(
    log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor,
    chunk_size: int = 128, state: LinearState | None = None, *, key_valid: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearState]:
    """Causal linear attention, chunk by chunk; continues from ``state`` (None = empty).

    log_q, log_k (B, H, T, M); v (B, H, T, dv) -> out (B, H, T, dv) in v's dtype, final state.
    Any T ≥ 0 and chunk_size ≥ 1 (the last chunk may be partial). key_valid (B, T) bool marks the
    new tokens' real keys (False = padding: no contribution); a row that sees no key outputs 0.
    log_decay (B, H, T) ≤ 0: the gate (module docstring); None = ungated.

    Per chunk of C tokens: three (C×M)/(C×C) matrix products and a few element-wise ops; each
    row's shift uses only keys it sees (:mod:`dofla.attention.stable`). Values carry a column of
    ones ([v | 1]) and the state is kept as [kv | k_sum], so numerator and denominator come out of
    the same products. Chunks are batched in groups of about ``groups.GROUP_TOKENS`` tokens
    (:func:`~dofla.attention.groups.chunk_group`): the in-chunk work of a group is one op per step, on tensors small
    enough to stay in cache; a group with a chunk on the stabiliser's guarded path, and a last
    partial chunk, go chunk by chunk (:func:`chunk_step`).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    out_dtype, length = v.dtype, v.shape[2]
    log_q, log_k, v, state, log_decay = _prepare(log_q, log_k, v, state, key_valid, log_decay)
    if length == 0:
        return v.new_zeros(v.shape).to(out_dtype), state
    dv = v.shape[-1]
    kv1 = torch.cat([state.kv, state.k_sum[..., None]], dim=-1)  # (B, H, M, dv+1)
    offset, outs = state.offset, []
    # without autograd, each group's output is written in place (no final concatenation)
    out = None if torch.is_grad_enabled() and any(x.requires_grad for x in (log_q, log_k, v, kv1)) else \
        v.new_empty(*v.shape)
    decays = None if log_decay is None else _chunk_decay(log_decay, chunk_size)
    flags = (_chunk_flags(log_q, log_k, decays, offset, chunk_size) if decide_ahead(log_q)
             else [None] * -(-length // chunk_size))
    group = max(1, groups.GROUP_TOKENS // chunk_size)
    for first in range(0, len(flags), group):
        start, stop = first * chunk_size, min(length, (first + group) * chunk_size)
        lq, lk, vc = (x[:, :, start:stop] for x in (log_q, log_k, v))
        vc = torch.cat([vc, vc.new_ones(*vc.shape[:3], 1)], dim=-1)  # [v | 1] (B, H, n, dv+1)
        decay = None if decays is None else decays[:, :, start:stop]
        full = (stop - start) // chunk_size * chunk_size
        done = None
        if full == stop - start:
            known = flags[first:first + group]
            done = chunk_group(lq, lk, vc, kv1, offset, chunk_size, decay, None if known[0] is None else all(known))
        if done is None:
            total, kv1, offset = _chunks_one_by_one(lq, lk, vc, kv1, offset, chunk_size, decay,
                                                   flags[first:first + group])
        else:
            total, kv1, offset = done
        den = total[..., dv:]
        den = torch.where(den > 0, den, 1.0)  # a row that sees no key: 0 / 1, a finite gradient
        if out is None:
            outs.append(total[..., :dv] / den)
        else:
            torch.div(total[..., :dv], den, out=out[:, :, start:stop])
    final = LinearState(kv1[..., :dv].contiguous(), kv1[..., dv].contiguous(), offset, state.length + length)
    return (torch.cat(outs, dim=2) if out is None else out).to(out_dtype), final


def _chunks_one_by_one(log_q, log_k, vals, kv1, offset, chunk: int, decay, flags):
    """The chunks of a group one at a time (:func:`chunk_step`): (total, kv1', offset')."""
    totals, mask = [], None
    for start, fast in zip(range(0, log_k.shape[2], chunk), flags):
        lq, lk, vc = (x[:, :, start:start + chunk] for x in (log_q, log_k, vals))
        if mask is None or mask.shape[0] != lk.shape[2]:
            mask = _causal_mask(lk.shape[2], vals)
            limit = torch.arange(1, lk.shape[2] + 1, device=vals.device)
        if decay is not None:  # decay counted from the chunk's start (B, H, C, 1)
            dc = decay[:, :, start:start + chunk]
            lq, lk = lq + dc, lk - dc
        total, _, kv1, offset = chunk_step(lq, lk, vc, kv1, offset, limit, mask, first_sees=True, fast=fast)
        if decay is not None:
            kv1, offset = carry_decay(kv1, offset, dc[:, :, -1])
        totals.append(total)
    return torch.cat(totals, dim=2), kv1, offset


def linear_attention_recurrent(
    log_q: torch.Tensor, log_k: torch.Tensor, v: torch.Tensor, state: LinearState | None = None,
    *, key_valid: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearState]:
    """The plain recurrence, one token at a time (decoding); same layouts as the chunked form.

    The state stays (B, H, M, dv) however many tokens have been seen. Its offset is the running
    maximum of keys already seen, so it is causal by construction; key_valid as in the chunked form.
    """
    out_dtype = v.dtype
    log_q, log_k, v, state, log_decay = _prepare(log_q, log_k, v, state, key_valid, log_decay)
    outs = []
    for t in range(v.shape[2]):
        old = state
        if log_decay is not None:  # S ← e^{a_t} S before the new key
            kv1, offset = carry_decay(torch.cat([state.kv, state.k_sum[..., None]], -1), state.offset,
                                       log_decay[:, :, t, None])
            old = LinearState(kv1[..., :-1], kv1[..., -1], offset, state.length)
        offset, scale = _advance(old, log_k[:, :, t])
        phi_k = torch.exp(log_k[:, :, t] - offset)  # (B, H, M)
        kv = old.kv * scale[..., None] + phi_k[..., None] * v[:, :, t, None, :]
        k_sum = old.k_sum * scale + phi_k
        phi_q = _query_features(log_q[:, :, t], offset)  # (B, H, M)
        num = torch.einsum("bhm,bhmv->bhv", phi_q, kv)
        den = (phi_q * k_sum).sum(-1)
        outs.append(num / torch.where(den > 0, den, 1.0)[..., None])  # no key seen: 0, finite gradient
        state = LinearState(kv, k_sum, offset, state.length + 1)
    if not outs:
        return v.new_zeros(v.shape).to(out_dtype), state
    return torch.stack(outs, dim=2).to(out_dtype), state
