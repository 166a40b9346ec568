"""What a student is made of, recorded in its ``config.json`` so it can be rebuilt from its teacher."""
from __future__ import annotations

from dataclasses import dataclass, field

from dofla.attention.forms import get_form

FORMAT_VERSION = 1
LINEAR_SCALES = ("fixed", "learned")


@dataclass
class ConversionSpec:
    """Everything needed to rebuild a student's attention from its teacher (saved in config.json)."""

    dims: list  # per layer: one int (every head) or a list of per-head ints (dof_head)
    feature_map: str = "learned_prf"
    feature_map_options: dict = field(default_factory=dict)
    chunk_size: int = 128
    seed: int = 0
    window: int = 0
    format_version: int = FORMAT_VERSION
    attention: str = "linear"  # a registered form (dofla.attention.forms; specs saved before: defaults)
    sinks: int = 0
    softmax_layers: list = field(default_factory=list)  # layers kept as exact softmax (they keep a KV cache)
    gate: str = "none"  # none | scalar: a per-head decay of each linear or hybrid layer's linear state
    linear_scale: str = "fixed"  # fixed | learned: a per-head weight of each hybrid layer's linear part
    # per layer, per KV head: a HeadPlan dict (dofla.models.plan); None (specs saved before it): the settings
    # above are shorthands that expand into it
    plan: list | None = None

    def __post_init__(self):
        if self.attention == "linear" and self.window > 0:
            self.attention = "hybrid"  # before `attention` existed, a window meant hybrid attention
        check_spec(self)


def check_spec(spec: ConversionSpec) -> None:
    """One clear sentence per user error in the attention settings: the general ones here, each form's
    own in its ``check`` (:mod:`dofla.attention.forms`)."""
    form = get_form(spec.attention)
    if spec.feature_map == "softmax" and (spec.attention != "linear" or spec.sinks):
        raise ValueError("feature_map='softmax' is the exact reference and takes no window or sinks; drop them")
    if spec.softmax_layers and spec.feature_map == "softmax":
        raise ValueError("softmax_layers restores layers of a linear, hybrid or sliding-window student to exact "
                         "softmax; feature_map='softmax' is exact everywhere already, drop softmax_layers")
    if spec.gate != "none" and spec.feature_map == "softmax":
        raise ValueError(f"gate={spec.gate!r} decays a linear state (linear or hybrid layers); attention="
                         f"{spec.attention!r} with feature_map={spec.feature_map!r} has none, set gate='none'")
    if spec.linear_scale not in LINEAR_SCALES or (spec.linear_scale == "learned" and not form.traits.scale):
        raise ValueError(f"linear_scale={spec.linear_scale!r} must be one of {', '.join(LINEAR_SCALES)}, and learned "
                         f"only with hybrid attention (it weighs the linear part against the window); set fixed")
    form.check(spec)
