"""The hybrid with a gated-delta state: exact softmax over the window and the sinks, the gated delta
rule for every token that has left the window.

A key enters the delta state when it leaves the window, in the order the hybrid moves keys out of
it (:mod:`dofla.attention.hybrid`): key j is written when row j + W arrives, so row i reads the
state S_{i−W} holding exactly the keys j ≤ i − W that are neither pads nor sinks (a sink stays
exact; a pad writes nothing and does not decay the state). The read ô_i = RMSNorm(S_{i−W}ᵀ q̂_i) ⊙ g ⊙
gate(v_i) is already an output (no normaliser), so it enters the hybrid's softmax merge as the older
keys' output, weighted by their mass, the gated linear kernel's Σ_{older} K̂_ij e^{A_i − A_j}
(A the cumulative log α, as the gated additive hybrid weighs them):

    y_i = (Σ_exact e^{s_ij} v_j + m_i ô_i) / (Σ_exact e^{s_ij} + m_i),   m_i = Σ_older K̂_ij e^{A_i − A_j}

On a context no longer than the window m_i = 0: the layer is the teacher's attention exactly. The
mass needs M numbers per head, the delta state M×dv, the window W keys and values.

Layouts: q, k (B, H, T, d) with q scaled so the exact kernel is exp(q·k/√d); v (B, H, T, dv); log_q,
log_k (B, H, T, M) feature-map log features. Keys and values expanded to H heads.
"""
from __future__ import annotations

import torch

from dofla.attention.delta import DeltaState, delta_rule_naive, unit_features
from dofla.attention.delta_backend import delta_rule
from dofla.attention.hybrid import HybridState, _exact_mask, _sink_keys, hybrid_attention_chunked, hybrid_log_scores


class DeltaReader:
    """The ``far`` reader of :func:`dofla.attention.hybrid.hybrid_attention_chunked` for a delta state."""

    def __init__(self, gates, chunk_size: int = 64):
        self.gates, self.chunk_size = gates, chunk_size

    def __call__(self, log_q, v_rows, log_k_leaving, v_leaving, keep, state: DeltaState | None):
        """The C new rows' reads (B, H, C, dv) and the state after the L leaving keys. Row c reads the
        state after min(L, c − (C − L) + 1) of them: the first C − L rows still see every leaving key
        exactly, so they read the carried state."""
        b, h, c, m = log_q.shape
        leave = log_k_leaving.shape[2]
        q_hat = unit_features(log_q)
        if state is None:
            state = DeltaState.zeros(b, h, m, v_rows.shape[-1], q_hat.dtype, q_hat.device)
        early, parts = c - leave, []
        if early:
            parts.append(q_hat[:, :, :early] @ state.S.to(q_hat.dtype))
        if leave:
            log_alpha, beta = self.gates(v_leaving)
            read, state = delta_rule(q_hat[:, :, early:], unit_features(log_k_leaving), v_leaving, log_alpha, beta,
                                     self.chunk_size, state, key_valid=keep)
            parts.append(read.to(q_hat.dtype))
        return self.gates.output(torch.cat(parts, dim=2), v_rows), state


def hybrid_delta_chunked(q, k, v, log_q, log_k, window: int, gates, chunk_size: int | None = None,
                         state: HybridState | None = None, *, sinks: int = 0, key_valid=None, softcap=None,
                         group: int = 1):
    """The hybrid with a delta state, in chunks (default chunk = window); continues from ``state``.
    ``gates``: the layer's :class:`~dofla.attention.delta_gates.DeltaGates`; ``group``: query heads per KV head
    (the window keeps each KV head's keys once, :func:`~dofla.attention.hybrid.hybrid_attention_chunked`).
    Returns (out, state)."""
    log_alpha, _ = gates(v)
    reader = DeltaReader(gates, chunk_size or window)
    return hybrid_attention_chunked(q, k, v, log_q, log_k, window, chunk_size, state, sinks=sinks,
                                    key_valid=key_valid, softcap=softcap, log_decay=log_alpha, far=reader, group=group)


def hybrid_delta_naive(q, k, v, log_q, log_k, window: int, gates, *, sinks: int = 0, key_valid=None,
                       softcap=None) -> torch.Tensor:
    """The plain reference: the (T, T) log scores of the gated hybrid for the exact part and the mass,
    the delta reads from the per-token recurrence on queries shifted by the window. Tests only."""
    b, _, t, _ = q.shape
    valid = torch.ones(b, t, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.to(torch.bool)
    log_alpha, beta = gates(v)
    scores = hybrid_log_scores(q, k, log_q, log_k, window, sinks, key_valid, softcap, log_alpha)
    sink = _sink_keys(valid, sinks)
    exact = _exact_mask(t, t, window, sink, q.device)[:, None]  # (B, 1, T, T)
    top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    e = torch.exp(scores - top)  # 0 on hidden keys
    near, mass = (e * exact) @ v.to(e.dtype), (e * ~exact).sum(-1, keepdim=True)
    q_hat, k_hat = unit_features(log_q), unit_features(log_k)
    ahead = torch.cat([q_hat[:, :, window:], q_hat.new_zeros(*q_hat.shape[:2], min(window, t), q_hat.shape[-1])], 2)
    read, _ = delta_rule_naive(ahead, k_hat, v.to(q_hat.dtype), log_alpha, beta, key_valid=valid & ~sink)
    read = torch.cat([read.new_zeros(*read.shape[:2], min(window, t), read.shape[-1]), read[:, :, :max(0, t - window)]], 2)
    far = gates.output(read, v)
    out = (near + mass * far) / ((e * exact).sum(-1, keepdim=True) + mass).clamp_min(torch.finfo(e.dtype).tiny)
    return out.to(v.dtype)
