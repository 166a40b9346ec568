"""A student as a plan per KV head: what each head of each layer keeps, and what that costs to decode.

A :class:`HeadPlan` is one KV head's attention: ``window`` (0: none, w: the last w tokens exact, ``ALL``:
every token exact, the teacher's KV cache), ``sinks`` (the first tokens kept exact beside a window),
``state`` (the linear state of the tokens older than the window: none, additive or delta), ``M`` (its
feature dimension, one int or one per query head of the KV head's group), ``gate`` (the scalar decay of an
additive state) and ``scale`` (a learned weight of a hybrid's linear part). A :class:`LayerPlan` is one
HeadPlan per KV head, a :class:`StudentPlan` the layers. The plan picks each head's form
(:func:`dofla.attention.forms.form_for`) and predicts the bytes one sequence's decode state holds.

The saved spec (``config.json``) carries the plan; the settings of the conversion (``attention``,
``window``, ``sinks``, ``gate``, ``linear_scale``, ``softmax_layers``, per-layer and per-head dims, and the
teacher's own sliding-window layers) are shorthands that :func:`expand` turns into it, so a student saved
before the plan existed means what it meant. A plan can also be given whole (:func:`read_plan`, a JSON or
YAML file), checked against the model's layers and heads before any weight loads.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from dofla.attention.forms import STATES, AttentionForm, Shape, form_for, get_form

ALL = "all"  # a window over every token: the head stays exact
PLAN_STATES = tuple(s for s in STATES if s != "kv")  # a head's state beside its window (exact heads: none)


@dataclass(frozen=True)
class HeadPlan:
    """One KV head's attention (module docstring)."""

    window: int | str = 0
    sinks: int = 0
    state: str = "none"
    M: int | tuple = 0
    gate: str = "none"
    scale: str = "fixed"
    form: str | None = None  # a registered form's name; None: the one its state and window pick (form_for)

    def __post_init__(self):
        if isinstance(self.M, list):
            object.__setattr__(self, "M", tuple(int(m) for m in self.M))

    @property
    def exact(self) -> bool:
        return self.window == ALL

    @property
    def attention_form(self) -> AttentionForm:
        if self.form is not None:
            return get_form(self.form)
        return get_form("softmax") if self.exact else form_for(self.state, self.window)

    @property
    def structure(self) -> tuple:
        """What heads that run one kernel call share: everything but an additive state's feature dims (those
        run in head blocks, as dof_head's do); the delta rule batches heads of one M only."""
        return (self.window, self.sinks, self.state, self.gate, self.scale, self.form,
                self.M if self.state == "delta" else None)

    # what a form's check reads (dofla.attention.forms): the head's settings as a spec names them
    @property
    def dims(self) -> list:
        return [list(self.M) if isinstance(self.M, tuple) else self.M]

    @property
    def linear_scale(self) -> str:
        return self.scale

    def features(self, group: int) -> tuple[int, ...]:
        """Feature dim of each of the ``group`` query heads reading this KV head (empty without a state)."""
        if self.state == "none":
            return ()
        return tuple(self.M) if isinstance(self.M, tuple) else (int(self.M),) * group

    def state_bytes(self, group: int, head_dim: int, tokens: int, kv_bytes: int = 4, kv_heads: int = 1,
                    features: tuple | None = None) -> int:
        """Bytes of one sequence's decode state after ``tokens`` tokens, for ``kv_heads`` KV heads of this plan
        (``group`` query heads each) run together; ``features`` of every query head (default: this head's)."""
        features = self.features(group) * kv_heads if features is None else features
        shape = Shape(group * kv_heads, kv_heads, head_dim, features)
        window = 0 if self.exact else self.window
        return self.attention_form.state_bytes(shape, window, self.sinks, self.gate != "none", tokens, kv_bytes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["M"] = list(self.M) if isinstance(self.M, tuple) else self.M
        if self.form is None:
            del out["form"]  # the form its state and window pick
        return out


LayerPlan = tuple  # of HeadPlan, one per KV head


@dataclass
class StudentPlan:
    """One :data:`LayerPlan` per layer."""

    layers: list = field(default_factory=list)

    def state_bytes(self, group: int, head_dim: int, tokens: int, kv_bytes: int = 4) -> int:
        """Bytes of one sequence's decode state after ``tokens`` tokens (``group`` query heads per KV head).
        The heads of a layer that differ at most in M run as one kernel call and one state (per-head dims
        in blocks), so they are counted together."""
        total = 0
        for heads in head_groups(self.layers):
            for layer_heads in heads:
                first = layer_heads[0]
                features = sum((h.features(group) for h in layer_heads), ())
                total += first.state_bytes(group, head_dim, tokens, kv_bytes, len(layer_heads), features)
        return total

    def dims(self, group: int) -> list:
        """The spec's ``dims`` of this plan: per layer one int, or one per query head (0 for a head with no
        state) where they differ."""
        out = []
        for layer in self.layers:
            flat = [m for head in layer for m in (head.features(group) or (0,) * group)]
            out.append(flat[0] if len(set(flat)) == 1 else flat)
        return out

    def to_list(self) -> list:
        return [[head.to_dict() for head in layer] for layer in self.layers]

    @classmethod
    def from_list(cls, layers: list) -> "StudentPlan":
        return cls([tuple(h if isinstance(h, HeadPlan) else HeadPlan(**h) for h in layer) for layer in layers])


def head_groups(layers) -> list[list[list[HeadPlan]]]:
    """Per layer, its heads grouped by :attr:`HeadPlan.structure` (in order of first appearance)."""
    return [[[layer[j] for j in kv_heads] for kv_heads in group_indices(layer)] for layer in layers]


def group_indices(layer) -> list[list[int]]:
    """The KV heads of a layer that share one structure (one kernel call), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for j, head in enumerate(layer):
        groups.setdefault(head.structure, []).append(j)
    return list(groups.values())


def expand(spec, geometry) -> StudentPlan:
    """The plan the shorthands of ``spec`` (a ConversionSpec) mean for a teacher of ``geometry``."""
    windows = getattr(geometry, "layer_windows", None) or [None] * geometry.num_layers
    group = geometry.num_heads // geometry.num_kv_heads
    layers = []
    for i in range(geometry.num_layers):
        layers.append(tuple(_head(spec, spec.dims[i], windows[i], i, j, group) for j in range(geometry.num_kv_heads)))
    return StudentPlan(layers)


def _head(spec, dims, teacher_window, layer: int, kv_head: int, group: int) -> HeadPlan:
    if spec.feature_map == "softmax" or (teacher_window is None and layer in spec.softmax_layers):
        return HeadPlan(window=ALL)
    if teacher_window is not None:  # already local in the teacher: kept exact over its window
        return HeadPlan(window=teacher_window)
    form = get_form(spec.attention)
    named = None if form_for(form.traits.state, spec.window) is form else form.name  # a form the pair does not pick
    if form.traits.state == "none":
        return HeadPlan(window=spec.window, sinks=spec.sinks, form=named)
    m = tuple(dims[kv_head * group:(kv_head + 1) * group]) if isinstance(dims, (list, tuple)) else int(dims)
    return HeadPlan(spec.window, spec.sinks, form.traits.state, m, spec.gate, spec.linear_scale, named)


def check_plan(plan: StudentPlan, geometry) -> None:
    """One sentence per error of a plan given whole, against the teacher's layers and heads."""
    if len(plan.layers) != geometry.num_layers:
        raise ValueError(f"the plan has {len(plan.layers)} layers but the model has {geometry.num_layers}; "
                         "give one list of heads per layer")
    group = geometry.num_heads // geometry.num_kv_heads
    for i, layer in enumerate(plan.layers):
        if len(layer) != geometry.num_kv_heads:
            raise ValueError(f"layer {i} of the plan has {len(layer)} heads but the model has "
                             f"{geometry.num_kv_heads} key/value heads; give one per key/value head")
        for j, head in enumerate(layer):
            check_head(head, group, f"layer {i} head {j}")


def check_head(head: HeadPlan, group: int, where: str) -> None:
    """One sentence per error of one head's plan."""
    if head.state not in PLAN_STATES:
        raise ValueError(f"{where}: state={head.state!r} is not one of {', '.join(PLAN_STATES)}")
    if head.exact:
        if head.state != "none" or head.sinks:
            raise ValueError(f"{where}: window='all' keeps every token exact; it takes no state or sinks, drop them")
        return
    if not isinstance(head.window, int) or head.window < 0:
        raise ValueError(f"{where}: window={head.window!r} must be 0 (none), a number of tokens or 'all'")
    if head.state == "none" and head.window < 1:
        raise ValueError(f"{where}: a head with no state and no window attends to nothing; give it a window or a state")
    features = head.features(group)
    if head.state != "none" and (len(features) != group or min(features) < 1):
        raise ValueError(f"{where}: M={head.to_dict()['M']!r} must be a positive feature dim, or one per query "
                         f"head of its group ({group})")
    form = head.attention_form
    if head.form is not None and (form.traits.state != (head.state if not head.exact else "kv")
                                  or not form.accepts(0 if head.exact else head.window)):
        raise ValueError(f"{where}: form={head.form!r} keeps a {form.traits.state!r} state with window "
                         f"{form.traits.window}; give it that state and window, or drop form")
    form.check(head)


def read_plan(path: str | Path) -> StudentPlan:
    """A plan from a JSON or YAML file: a list of layers, each a list of head dicts (HeadPlan's fields);
    or a dict with that list under ``layers``."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"plan file {path} does not exist; give the path of a JSON or YAML plan")
    text = path.read_text()
    raw = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    layers = raw.get("layers") if isinstance(raw, dict) else raw
    if not isinstance(layers, list) or not all(isinstance(layer, list) for layer in layers):
        raise ValueError(f"plan file {path} holds no list of layers (each a list of heads); see dofla.models.plan")
    try:
        return StudentPlan.from_list(layers)
    except TypeError as error:
        raise ValueError(f"plan file {path}: a head has a field that is not one of window, sinks, state, M, "
                         f"gate, scale ({error})") from None
