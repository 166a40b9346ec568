"""The student's layers as its plan builds them (:mod:`dofla.models.plan`): a layer whose KV heads share
one structure (they differ at most in their feature dims) is one
:class:`~dofla.models.student_attention.StudentAttention` over every head, as before the plan existed;
a layer whose heads differ is a :class:`~dofla.models.student_attention.MixedAttention` of one
StudentAttention per group of heads of one structure, each group one kernel call.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from dofla.feature_maps import build_layer_feature_map
from dofla.models.adapters import get_adapter
from dofla.models.plan import StudentPlan, check_plan, expand, group_indices, read_plan
from dofla.models.spec import ConversionSpec
from dofla.models.mixed_attention import MixedAttention
from dofla.models.student_attention import ATTN_IMPLEMENTATION, StudentAttention

# convert()'s settings that a plan given whole replaces, at their defaults
REPLACED = {"dims": None, "window": 0, "attention": "linear", "sinks": 0, "softmax_layers": None, "gate": "none",
            "linear_scale": "fixed"}


def install_linear_attention(model: nn.Module, spec: ConversionSpec) -> None:
    """Attach each layer's StudentAttention, as the spec's plan says (its shorthands expanded when it has
    none; see the module docstring for what each layer gets)."""
    adapter = get_adapter(model)
    geometry = adapter.geometry(model.config)
    modules = adapter.attention_modules(model)
    if len(spec.dims) != len(modules):
        raise ValueError(f"dims has {len(spec.dims)} entries but the model has {len(modules)} layers")
    plan = student_plan(spec, geometry)
    for i, module in enumerate(modules):
        module.dofla = _layer_attention(spec, geometry, i, plan.layers[i])
    model.config._attn_implementation = ATTN_IMPLEMENTATION


def student_plan(spec: ConversionSpec, geometry) -> StudentPlan:
    """The spec's plan (checked against the teacher's layers and heads), or what its shorthands mean."""
    if spec.plan is None:
        return expand(spec, geometry)
    plan = StudentPlan.from_list(spec.plan)
    check_plan(plan, geometry)
    return plan


def _layer_attention(spec: ConversionSpec, geometry, i: int, layer: tuple) -> StudentAttention:
    """Layer ``i`` as its plan says: one StudentAttention over every head when its heads differ at most
    in their feature dims (today's layers), else a mixed layer of one per group of heads."""
    groups = group_indices(layer)
    if len(groups) > 1:
        return MixedAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, groups,
                              [_group_attention(spec, geometry, i, [layer[j] for j in kv], len(kv)) for kv in groups])
    return _group_attention(spec, geometry, i, list(layer), geometry.num_kv_heads)


def _group_attention(spec: ConversionSpec, geometry, i: int, heads: list, kv_heads: int) -> StudentAttention:
    """One StudentAttention over ``kv_heads`` KV heads of one structure (``heads``, their plans)."""
    group = geometry.num_heads // geometry.num_kv_heads
    head, softcap = heads[0], getattr(geometry, "softcap", None)
    form, window = head.attention_form, 0 if head.exact else head.window
    features = None
    if head.state != "none":
        dims = [m for h in heads for m in h.features(group)]
        features = build_layer_feature_map(spec.feature_map, group * kv_heads, geometry.head_dim,
                                           dims[0] if len(set(dims)) == 1 else dims, seed=spec.seed + i,
                                           **spec.feature_map_options)
    parts = form.build(head, features, group * kv_heads, geometry.head_dim)
    return StudentAttention(group * kv_heads, kv_heads, geometry.head_dim, chunk_size=spec.chunk_size, window=window,
                            sinks=head.sinks, softcap=None if head.window == 0 else softcap, state=head.state,
                            form=form, **parts)


def plan_layers(plan: StudentPlan, geometry, feature_map: str = "learned_prf", feature_map_options: dict | None = None,
                seed: int = 0, chunk_size: int = 128) -> list:
    """Each layer's attention as :func:`~dofla.models.convert` builds it for ``plan`` (the same modules, the same
    seeds), without a model: what the layerwise stage trains before any student exists."""
    dims = plan.dims(geometry.num_heads // geometry.num_kv_heads)
    spec = ConversionSpec(dims, feature_map, dict(feature_map_options or {}), chunk_size, seed)
    return [_layer_attention(spec, geometry, i, layer) for i, layer in enumerate(plan.layers)]


def given_plan(plan, geometry, **settings) -> StudentPlan:
    """A plan given whole (a StudentPlan, its list of layers, or a JSON/YAML file), checked against the
    teacher's layers and heads; ``settings`` are convert()'s others, which the plan replaces."""
    changed = [name for name, value in settings.items() if value not in (REPLACED[name], [])]
    if changed:
        raise ValueError(f"a plan given whole sets every head's window, sinks, state, M and gate; drop "
                         f"{', '.join(changed)} (or drop the plan)")
    if isinstance(plan, (str, Path)):
        plan = read_plan(plan)
    elif not isinstance(plan, StudentPlan):
        plan = StudentPlan.from_list(plan)
    check_plan(plan, geometry)
    return plan


def checked_plan_file(path: str | Path, config) -> StudentPlan:
    """The plan in ``path`` checked against a teacher's config alone (its layers and KV heads), so a run
    refuses a wrong plan before any weight loads."""
    plan = read_plan(path)
    check_plan(plan, get_adapter(config).geometry(config))
    return plan
