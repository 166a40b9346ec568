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
from dofla.models.spec import ConversionSpec, check_spec
from dofla.models.student_attention import StudentAttention


def restorable_layers(model: PreTrainedModel) -> list[int]:
    """The layers :func:`restore_softmax` can make exact: linear, hybrid and the student's own
    sliding-window layers; not those already exact, nor a teacher's own sliding-window layers
    (Gemma 2, Mistral: exact in every student already)."""
    geometry = get_adapter(model).geometry(model.config)
    windows = getattr(geometry, "layer_windows", None) or (None,) * geometry.num_layers
    return [i for i, attn in enumerate(model.student_attentions()) if attn.form.traits.state != "kv" and windows[i] is None]


def restore_softmax(model: PreTrainedModel, layers) -> PreTrainedModel:
    """Turn ``layers`` of a student (in place) back into exact softmax attention, recorded in
    ``config.dofla["softmax_layers"]`` so the saved student loads the same way. Those layers drop
    their feature maps (or window) and keep a KV cache when decoding (memory grows with the tokens)."""
    spec = ConversionSpec(**model.config.dofla)
    chosen = sorted(set(spec.softmax_layers) | {int(i) for i in layers})
    spec.softmax_layers = chosen
    check_spec(spec)
    attentions = model.student_attentions()
    bad = [i for i in chosen if not 0 <= i < len(attentions)]
    if bad:
        raise ValueError(f"softmax_layers {bad} are outside 0..{len(attentions) - 1} (the model has "
                         f"{len(attentions)} layers)")
    softcap, restorable = getattr(get_adapter(model).geometry(model.config), "softcap", None), restorable_layers(model)
    for i in chosen:
        if i in restorable:  # a teacher sliding-window layer is exact already
            _make_exact(attentions[i], softcap)
    model.config.dofla = asdict(spec)
    return model


@contextmanager
def softmax_restored(model: PreTrainedModel, layer: int | None):
    """Layer ``layer`` of a student as exact softmax inside the block, as it was after it (None:
    nothing changes). For measuring what restoring a layer would do, without saving anything."""
    if layer is None or layer not in restorable_layers(model):
        yield model
        return
    attn = model.student_attentions()[layer]
    softcap = getattr(get_adapter(model).geometry(model.config), "softcap", None)
    before = _make_exact(attn, softcap)
    try:
        yield model
    finally:
        attn.feature_map, attn.window, attn.sinks, attn.softcap, attn.gate, attn.linear_log_scale = before


def _make_exact(attn: StudentAttention, softcap: float | None) -> tuple:
    """Switch ``attn`` to the softmax mode (no features, window, sinks, gate or linear scale: a saved
    student's exact layers have none); returns what it had."""
    before = (attn.feature_map, attn.window, attn.sinks, attn.softcap, attn.gate, attn.linear_log_scale)
    attn.feature_map, attn.window, attn.sinks, attn.softcap, attn.gate, attn.linear_log_scale = (
        None, 0, 0, softcap, None, None)
    return before
