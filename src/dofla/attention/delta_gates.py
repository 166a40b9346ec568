"""A gated-delta layer's trained part: its feature map and its gates (the write strength β, the decay
α, the output gate and the per-head RMS normalisation of Gated DeltaNet).

Per head h and token t, from the layer's value vector v_t (after GQA expansion):

    β_t = σ(w_β·v̄_t + b_β),   log α_t = −softplus(w_α·v̄_t + b_α),
    out_t = RMSNorm(o_t) ⊙ g_h ⊙ 2σ(W_g v̄_t + b_g),      v̄_t = v_t/√d

(the 1/√d keeps a weight's step under Adam, which moves every entry by about the learning rate,
from moving the gates by d times as much: the weights start at 0 and a coherent step in all d
entries of W_g changed the output gate by tens of percent within ten steps at 1e-2.)

Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025) projects the layer input x_t for all three and
gates with SiLU. Here they read v_t: the attention interface of a converted layer receives q, k, v
(not the hidden state), and so do the layerwise stage's activation cache and stream, so a gate that
reads v trains layer by layer like the features do. v_t = W_v x_t is a linear image of the input,
so the departure narrows what the gates can see to what the teacher's value projection keeps. The
output gate is 2σ(·) rather than SiLU(·) so that it starts at exactly 1 (the teacher has no output
gate; SiLU(0) = 0 would silence the layer).

Initialisation (the first step close to the teacher's attention on short context): all weights 0,
so every head starts with constant gates. β₀ = :data:`BETA_INIT` and α₀ = exp(−:data:`DECAY_INIT`)
make the state an almost additive, almost undecayed memory: with small β the delta rule's
corrections are second order and o_t ≈ β Σ_j (q̂_t·k̂_j) v_j, the linear-attention read of the
trained feature map without its normaliser, whose scale the RMS normalisation removes; α₀^T stays
near 1 over a few hundred tokens. Training then raises β where overwriting helps and lowers α where
forgetting helps. The normalisation's gain g sets the output's scale, which the teacher's weights do
not fix; it starts at 1 and :meth:`DeltaFeatureMap.calibrate_` sets it from data once (as ActNorm
does): the layerwise stage calls it on its first batch with the teacher's attention output, and it
takes, per head and channel, the least-squares gain (the output is linear in g), kept as a fixed
scale beside the trained weight (g = weight · scale, the weight starting at 1).

Layouts: v (B, H, T, d) -> β, log α (B, H, T); o (B, H, T, dv) -> (B, H, T, dv).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dofla.attention.delta import unit_features
from dofla.attention.delta_backend import delta_rule
from dofla.attention.delta_hybrid import hybrid_delta_chunked

BETA_INIT = 0.1
DECAY_INIT = 1e-3  # −log α at the start: a memory of about a thousand tokens
NORM_EPS = 1e-6


class DeltaGates(nn.Module):
    """β, log α, the output gate and the RMS-norm gain of every head (module docstring)."""

    def __init__(self, num_heads: int, head_dim: int, beta_init: float = BETA_INIT, decay_init: float = DECAY_INIT):
        super().__init__()
        if not 0 < beta_init < 1 or not decay_init > 0:
            raise ValueError(f"beta_init={beta_init} must be in (0, 1) and decay_init={decay_init} > 0")
        self.beta_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.beta_bias = nn.Parameter(torch.full((num_heads,), math.log(beta_init / (1 - beta_init))))
        self.decay_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.decay_bias = nn.Parameter(torch.full((num_heads,), math.log(math.expm1(decay_init))))
        self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim, head_dim))
        self.gate_bias = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.norm_weight = nn.Parameter(torch.ones(num_heads, head_dim))
        # the gain's scale, set once from data (DeltaFeatureMap.calibrate_): training moves norm_weight
        # around 1, so an Adam step changes the gain by a share, whatever its scale
        self.register_buffer("norm_scale", torch.ones(num_heads, head_dim))

    def forward(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """v (B, H, T, d) -> (log α, β), each (B, H, T), in float32 (or v's wider dtype)."""
        x = (v.float() if v.dtype in (torch.float16, torch.bfloat16) else v) * v.shape[-1] ** -0.5
        beta = torch.sigmoid(torch.einsum("bhtd,hd->bht", x, self.beta_weight.to(x.dtype))
                             + self.beta_bias.to(x.dtype)[:, None])
        log_alpha = -nn.functional.softplus(torch.einsum("bhtd,hd->bht", x, self.decay_weight.to(x.dtype))
                                            + self.decay_bias.to(x.dtype)[:, None])
        return log_alpha, beta

    def output(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) ⊙ g ⊙ 2σ(W_g v + b_g): o (B, H, T, dv) the state's read, v the same tokens' values."""
        o = o.float() if o.dtype in (torch.float16, torch.bfloat16) else o
        x = v.to(o.dtype) * v.shape[-1] ** -0.5
        gate = 2 * torch.sigmoid(torch.einsum("bhtd,hde->bhte", x, self.gate_weight.to(o.dtype))
                                 + self.gate_bias.to(o.dtype)[:, None])
        scale = o.pow(2).mean(-1, keepdim=True).add(NORM_EPS).rsqrt()
        return o * scale * (self.norm_weight * self.norm_scale).to(o.dtype)[:, None] * gate


class DeltaFeatureMap(nn.Module):
    """A gated-delta layer's trained part, standing where a linear layer's feature map stands: the
    layerwise stage trains it, its artifact holds its state dict, the student loads it. It answers
    ``log_features`` like the feature map it holds; :meth:`attend` is the layer's attention.

    The state per head is M×dv, M the feature map's dimension (the allocation's dims, as for
    linear attention); keys are φ(k)/‖φ(k)‖ and queries φ(q)/‖φ(q)‖ (the RMS normalisation of the
    read makes the query's scale irrelevant, so normalising it changes nothing but the range).
    """

    def __init__(self, features: nn.Module, gates: DeltaGates):
        super().__init__()
        self.features = features
        self.gates = gates
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))  # calibrate_ has run

    @property
    def num_features(self):
        return self.features.num_features

    @property
    def num_heads(self) -> int:
        return self.features.num_heads

    @property
    def head_dim(self) -> int:
        return self.features.head_dim

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features.log_features(x)

    def param_groups(self) -> list[dict]:
        """The feature map's named Adam groups (z, alpha, ...) and the gates' (``gates``)."""
        named = getattr(self.features, "param_groups", None)
        groups = named() if named is not None else [{"name": "other", "params": list(self.features.parameters())}]
        groups = [{"name": g["name"], "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
        groups.append({"name": "gates", "params": [p for p in self.gates.parameters() if p.requires_grad]})
        return [g for g in groups if g["params"]]

    def attend(self, q, k, v, state=None, *, key_valid=None, window: int = 0, sinks: int = 0, softcap=None,
               chunk_size: int = 64, log_q=None, log_k=None, group: int = 1):
        """The layer's attention: q, k, v (B, H, T, d) (keys and values expanded to H heads, q scaled
        so the teacher's kernel is exp(q·k/√d)); ``window`` 0 is pure gated delta (state
        :class:`~dofla.attention.delta.DeltaState`), > 0 the hybrid whose older tokens live in the
        delta state (:mod:`dofla.attention.delta_hybrid`), whose window keeps each KV head's keys once when
        ``group`` (query heads per KV head) > 1. Returns (out (B, H, T, dv) in v's dtype, state)."""
        log_q = self.log_features(q) if log_q is None else log_q
        log_k = self.log_features(k) if log_k is None else log_k
        if window > 0:
            return hybrid_delta_chunked(q, k, v, log_q, log_k, window, self.gates, chunk_size, state, sinks=sinks,
                                        key_valid=key_valid, softcap=softcap, group=group)
        log_alpha, beta = self.gates(v)
        o, state = delta_rule(unit_features(log_q), unit_features(log_k), v, log_alpha, beta, chunk_size, state,
                              key_valid=key_valid)
        return self.gates.output(o, v).to(v.dtype), state

    @torch.no_grad()
    def calibrate_(self, q, k, v, y, **attend) -> None:
        """Set the gain g (H, dv) once, to the least-squares fit of this batch's teacher attention output
        y (B, H, T, dv): the output is a + g·b per head and channel (a the exact part of a hybrid, 0
        when pure), so g = Σ (y − a)·b / Σ b² over batch and time. ``attend``: :meth:`attend`'s options."""
        weight, scale = self.gates.norm_weight, self.gates.norm_scale
        start = (weight * scale).detach()
        weight.fill_(1.0)
        scale.zero_()
        base = self.attend(q, k, v, **attend)[0].float()
        scale.fill_(1.0)
        unit = self.attend(q, k, v, **attend)[0].float() - base
        num, den = ((y.float() - base) * unit).sum((0, 2)), unit.pow(2).sum((0, 2))
        scale.copy_(torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), start).to(scale.dtype))
        self.calibrated.fill_(True)

    def extra_repr(self) -> str:
        return f"features={self.num_features}"

