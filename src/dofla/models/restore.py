"""Layers of a student restored to exact softmax attention: its linear or hybrid layers, or the
sliding-window layers of a training-free (``sliding_window``) student.

A restored layer drops its feature map (or window) and attends exactly, through the teacher's own mask; when
decoding it keeps every key and value, like the teacher (its memory grows with the tokens). The
choice is recorded in ``config.dofla["softmax_layers"]``, so a saved student loads with the same
layers exact. :func:`softmax_restored` restores one layer for the duration of a block, to measure
what keeping it exact would do (``dofla.dof.softmax_layers``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict

from transformers import PreTrainedModel

from dofla.models.adapters import get_adapter
from dofla.models.plan import ALL, HeadPlan, StudentPlan
from dofla.models.spec import ConversionSpec, check_spec
from dofla.models.student_attention import StudentAttention


def restorable_layers(model: PreTrainedModel) -> list[int]:
    """The layers :func:`restore_softmax` can make exact: linear, hybrid and the student's own
    sliding-window layers; not those already exact, nor a teacher's own sliding-window layers
    (Gemma 2, Mistral: exact in every student already)."""
    geometry = get_adapter(model).geometry(model.config)
    windows = getattr(geometry, "layer_windows", None) or (None,) * geometry.num_layers
    return [i for i, attn in enumerate(model.student_attentions()) if not attn.keeps_kv_cache and windows[i] is None]


def restore_softmax(model: PreTrainedModel, layers) -> PreTrainedModel:
    """Turn ``layers`` of a student (in place) back into exact softmax attention, recorded in
    ``config.dofla["softmax_layers"]`` (and in its plan) so the saved student loads the same way. Those layers
    drop their feature maps (or window) and keep a KV cache when decoding (memory grows with the tokens)."""
    spec = ConversionSpec(**model.config.dofla)
    chosen = sorted(set(spec.softmax_layers) | {int(i) for i in layers})
    spec.softmax_layers = chosen
    check_spec(spec)
    modules = get_adapter(model).attention_modules(model)
    bad = [i for i in chosen if not 0 <= i < len(modules)]
    if bad:
        raise ValueError(f"softmax_layers {bad} are outside 0..{len(modules) - 1} (the model has "
                         f"{len(modules)} layers)")
    restorable = restorable_layers(model)
    plan = None if spec.plan is None else StudentPlan.from_list(spec.plan)
    for i in chosen:
        if i in restorable:  # a teacher sliding-window layer is exact already
            modules[i].dofla = _exact(model, modules[i].dofla)
            if plan is not None:
                plan.layers[i] = tuple(HeadPlan(window=ALL) for _ in plan.layers[i])
    spec.plan = None if plan is None else plan.to_list()
    model.config.dofla = asdict(spec)
    return model


@contextmanager
def softmax_restored(model: PreTrainedModel, layer: int | None):
    """Layer ``layer`` of a student as exact softmax inside the block, as it was after it (None:
    nothing changes). For measuring what restoring a layer would do, without saving anything."""
    if layer is None or layer not in restorable_layers(model):
        yield model
        return
    module = get_adapter(model).attention_modules(model)[layer]
    before = module.dofla
    module.dofla = _exact(model, before)
    try:
        yield model
    finally:
        module.dofla = before


def _exact(model: PreTrainedModel, attn) -> StudentAttention:
    """An exact softmax layer in place of ``attn`` (no features, window, sinks, gate or linear scale: a saved
    student's exact layers have none), on its device."""
    softcap = getattr(get_adapter(model).geometry(model.config), "softcap", None)
    exact = StudentAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, None, softcap=softcap)
    exact.chunk_size = getattr(attn, "chunk_size", exact.chunk_size)
    return exact
