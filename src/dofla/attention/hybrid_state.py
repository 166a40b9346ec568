"""The hybrid attention's decoding state (:mod:`dofla.attention.hybrid`): the linear state of the tokens
that left the window, the window's keys and values, and the sinks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dofla.attention.delta import DeltaState
from dofla.attention.linear import LinearState


@dataclass
class HybridState:
    """Linear state of tokens older than the window (sinks excepted), the window's last ≤ W
    keys/values, and the sink tokens that have left the window, each with key validity.

    k (B, H_kv, n, d), v (B, H_kv, n, dv) (each KV head's once; H_kv = H without grouping), log_k (B, H, n, M),
    valid (B, n), is_sink (B, n): which window keys are sinks of their row. sink_k (B, H_kv, s, d),
    sink_v (B, H_kv, s, dv), sink_valid (B, s)
    with s ≤ sinks: row b's sinks that left the window fill its slots 0, 1, … in order.
    ``linear.length`` counts every position that left the window (pads and sinks included).
    ``sinks_held`` (a host-side bool): every row holds all its sinks, so none can be in the window any
    more and the steps skip the sink bookkeeping without asking the device. ``decay`` (B, H, n): the
    gate's log decays at the window's positions (None: ungated so far); the linear state is decayed
    up to the last position seen. ``delta``: a ``far`` reader's state (None: none, or empty so far).
    """

    linear: LinearState
    k: torch.Tensor
    v: torch.Tensor
    log_k: torch.Tensor
    valid: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_valid: torch.Tensor
    is_sink: torch.Tensor
    sinks_held: bool = False
    decay: torch.Tensor | None = None
    delta: DeltaState | None = None

    @property
    def length(self) -> int:
        return self.linear.length + self.k.shape[2]

    def _tensors(self):
        return (self.k, self.v, self.log_k, self.valid, self.sink_k, self.sink_v, self.sink_valid, self.is_sink)

    def index_select(self, index: torch.Tensor) -> "HybridState":
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        decay = None if self.decay is None else pick(self.decay)
        delta = None if self.delta is None else self.delta.index_select(index)
        return HybridState(self.linear.index_select(index), *(pick(t) for t in self._tensors()), self.sinks_held, decay,
                           delta)

    def nbytes(self) -> int:
        extra = () if self.decay is None else (self.decay,)
        delta = 0 if self.delta is None else self.delta.nbytes()
        return self.linear.nbytes() + delta + sum(t.numel() * t.element_size() for t in self._tensors() + extra)
