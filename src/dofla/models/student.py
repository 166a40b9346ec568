"""Convert a teacher into a linear-attention student that is still a Hugging Face model.

``convert`` attaches a :class:`StudentAttention` (feature map with a per-layer feature dimension)
to every attention module, routes attention through ``dofla_linear`` and records the conversion
in ``config.dofla``. ``save_pretrained`` then writes the teacher weights, the feature parameters
and the dims; :func:`load_student` rebuilds the same model; ``generate()`` decodes with a
fixed-size recurrent state.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from dofla.feature_maps import build_layer_feature_map
from dofla.models.adapters import get_adapter
from dofla.models.student_attention import (
    ATTN_IMPLEMENTATION,
    RecurrentStateCache,
    StudentAttention,
)

FORMAT_VERSION = 1


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


class StudentMixin:
    """Mixed into the teacher's own class: installs linear attention and its decoding cache."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        spec = getattr(config, "dofla", None)
        if spec is not None:
            install_linear_attention(self, ConversionSpec(**spec))

    def student_attentions(self) -> list[StudentAttention]:
        return [module.dofla for module in get_adapter(self).attention_modules(self)]

    def forward(self, *args, **kwargs):
        cache = kwargs.get("past_key_values")
        use_cache = kwargs.get("use_cache")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = kwargs["past_key_values"] = RecurrentStateCache(len(self.student_attentions()))
        if cache is not None and not isinstance(cache, RecurrentStateCache):
            raise TypeError(
                f"a dofla student decodes with RecurrentStateCache, got {type(cache).__name__}; "
                "pass past_key_values=None and let the model create its cache"
            )
        students = self.student_attentions()
        for i, student in enumerate(students):
            student.cache_layer = None if cache is None else cache.layers[i]
        try:
            return super().forward(*args, **kwargs)
        finally:
            for student in students:
                student.cache_layer = None

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = RecurrentStateCache(len(self.student_attentions()))
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


@functools.cache
def student_class(base: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """The student class for a teacher class, e.g. LlamaForCausalLM -> LinearLlamaForCausalLM."""
    return type(f"Linear{base.__name__}", (StudentMixin, base), {"__module__": __name__})


def install_linear_attention(model: nn.Module, spec: ConversionSpec) -> None:
    """Attach a StudentAttention with ``spec.dims[i]`` features to each layer's attention."""
    adapter = get_adapter(model)
    geometry = adapter.geometry(model.config)
    modules = adapter.attention_modules(model)
    if len(spec.dims) != len(modules):
        raise ValueError(f"dims has {len(spec.dims)} entries but the model has {len(modules)} layers")
    for i, module in enumerate(modules):
        feature_map = None
        if spec.feature_map != "softmax":
            feature_map = build_layer_feature_map(
                spec.feature_map, geometry.num_heads, geometry.head_dim, spec.dims[i],
                seed=spec.seed + i, **spec.feature_map_options,
            )
        module.dofla = StudentAttention(
            geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, feature_map,
            spec.chunk_size, spec.window,
        )
    model.config._attn_implementation = ATTN_IMPLEMENTATION


def convert(
    model: PreTrainedModel,
    feature_map: str = "learned_prf",
    dims: list | None = None,
    feature_map_options: dict | None = None,
    chunk_size: int = 128,
    seed: int = 0,
    window: int = 0,
) -> PreTrainedModel:
    """Turn ``model`` (in place) into a linear-attention student and return it.

    ``dims`` holds one feature dimension per layer (default: the head size everywhere, the paper's
    ``fix`` policy), or for a layer a list of per-head dims (heads of equal dim share one block). ``feature_map="softmax"`` swaps in the exact softmax reference instead.
    The teacher weights are shared, not copied; deep-copy the teacher first to keep it.
    """
    if isinstance(model, StudentMixin):
        raise ValueError("model is already a dofla student; convert its teacher instead")
    geometry = get_adapter(model).geometry(model.config)
    dims = [geometry.head_dim] * geometry.num_layers if dims is None else [_layer_dims(m) for m in dims]
    spec = ConversionSpec(dims, feature_map, dict(feature_map_options or {}), chunk_size, seed, window)
    device = next(model.parameters()).device
    install_linear_attention(model, spec)
    model.config.dofla = asdict(spec)
    model.__class__ = student_class(type(model))
    return model.to(device)


def _layer_dims(m):
    return int(m) if isinstance(m, (int, float)) else [int(x) for x in m]


def load_student(path: str | Path, **kwargs) -> PreTrainedModel:
    """Load a student saved with ``save_pretrained`` (weights, feature parameters, dims)."""
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "dofla", None) is None:
        raise ValueError(f"{path} holds no dofla student (config.json has no 'dofla' entry)")
    base = AutoModelForCausalLM._model_mapping[type(config)]
    model = student_class(base).from_pretrained(path, config=config, **kwargs)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model.eval()
