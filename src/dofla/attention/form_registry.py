"""The registry of attention forms: what a form declares (:class:`Traits`), the geometry its state is
counted on (:class:`Shape`), the base class every form subclasses, and the lookups. The forms themselves
are in :mod:`dofla.attention.forms`, which registers them on import (import forms from there)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dofla.attention.gate import build_gate

STATES = ("kv", "none", "additive", "delta")
STATE_BYTES = 4  # the kernels keep their states in float32 (at least)
REQUIRED, OPTIONAL, NEVER = "required", "optional", "never"


@dataclass(frozen=True)
class Traits:
    """What a form is: ``trains`` (has parameters to distil), ``window`` (a window of exact recent tokens:
    required, optional or never), ``sinks`` (may keep its first tokens exact, with a window), ``gate``
    (takes the scalar decay gate), ``scale`` (takes a learned linear scale), ``state`` (one of STATES),
    ``shares_layers`` (its trained layers are plain feature maps, which linear and hybrid runs of the
    same settings share; False: the layers' artifact meta names the form)."""

    trains: bool
    window: str
    sinks: bool
    gate: bool
    scale: bool
    state: str
    shares_layers: bool = True


@dataclass(frozen=True)
class Shape:
    """The heads a form serves: ``heads`` query heads reading ``kv_heads`` key/value heads of size
    ``head_dim``; ``features`` the feature dim of each query head (empty without a linear state)."""

    heads: int
    kv_heads: int
    head_dim: int
    features: tuple[int, ...] = ()


class AttentionForm:
    """A registered attention form (module docstring); subclasses set ``name`` and ``traits``."""

    name: ClassVar[str]
    traits: ClassVar[Traits]
    selectable: ClassVar[bool] = True  # named by the config's attention.name

    def check(self, settings) -> None:
        """One sentence per user error in ``settings`` (the traits' rules; forms add their own)."""
        if self.traits.window == REQUIRED and settings.window < 1:
            raise ValueError(f"attention={self.name!r} needs window ≥ 1 (recent tokens attended exactly), "
                             f"got {settings.window}; set window")
        if settings.gate != "none" and not self.traits.gate:
            raise ValueError(f"gate={settings.gate!r} decays a linear state (linear or hybrid layers); attention="
                             f"{self.name!r} has none, set gate='none'")
        if settings.sinks < 0 or (settings.sinks and not self.traits.sinks):
            raise ValueError(f"sinks={settings.sinks} needs to be ≥ 0, and > 0 only with hybrid or sliding_window "
                             "attention; set sinks=0 or choose one of those")

    def build(self, settings, features, heads: int, head_dim: int) -> dict:
        """The layer's trained parts: ``feature_map`` (``features`` as this form uses it), ``gate``,
        ``learned_scale``."""
        return {"feature_map": features if self.traits.state in ("additive", "delta") else None,
                "gate": build_gate(settings.gate, heads, head_dim) if self.traits.gate else None,
                "learned_scale": self.traits.scale and settings.linear_scale == "learned"}

    def attend(self, layer, q, k, v, state=None, key_valid=None, softcap=None):
        raise NotImplementedError

    def accepts(self, window: int) -> bool:
        """Whether a layer of this form may have ``window`` (0: none)."""
        return self.traits.window == OPTIONAL or (self.traits.window == REQUIRED) == (window > 0)

    def trained_part(self, features):
        """What the layerwise stage trains for a layer of this form, from its fresh feature map."""
        return features

    def step(self, layer, q, k, v, state, key_valid=None, softcap=None):
        """One decoding token against ``state``: the prefill path unless a form has a faster one."""
        return self.attend(layer, q, k, v, state, key_valid, softcap)

    def state_bytes(self, shape: Shape, window: int, sinks: int, gate: bool, tokens: int, kv_bytes: int = 4) -> int:
        """Bytes of one sequence's decode state after ``tokens`` tokens (what its cache holds)."""
        raise NotImplementedError


FORMS: dict[str, AttentionForm] = {}


def register(form: type[AttentionForm]) -> type[AttentionForm]:
    """Class decorator: register one instance of ``form`` under its name."""
    if form.traits.state not in STATES:
        raise ValueError(f"form {form.name!r} keeps state {form.traits.state!r}, not one of {', '.join(STATES)}")
    FORMS[form.name] = form()
    return form


def get_form(name: str) -> AttentionForm:
    if name not in FORMS:
        raise ValueError(f"attention={name!r} is not one of {', '.join(selectable())}; pick one of them")
    return FORMS[name]


def selectable() -> tuple[str, ...]:
    """The forms a config may name (``attention.name``), in registration order."""
    return tuple(name for name, form in FORMS.items() if form.selectable)


def form_for(state: str, window: int) -> AttentionForm:
    """The form that keeps ``state`` with ``window`` (0: none): what a layer is after a part of it is set aside
    (a window dropped, features detached) or when a plan names a state and a window instead of a form."""
    for form in FORMS.values():
        if form.traits.state == state and form.accepts(window):
            return form
    raise ValueError(f"no attention form keeps a {state!r} state with window {window}")
