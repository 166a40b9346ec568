"""Replaying a model's first layers from a recorded forward, so that only the layers after them run.

Two students that differ from layer l on compute the same hidden states in layers 0..l-1, so the second
one need not compute them again: :func:`recording` keeps every decoder layer's output of one forward (the
exact object the layer returned, a tensor or a tuple), and :func:`replaying` makes layers 0..l-1 of another
model return those outputs without running. The model's own forward still runs around them: it embeds the
tokens and builds its masks and rotary or learned position embeddings itself, and its later layers read the
replayed hidden states as they would the computed ones. That holds for any model whose decoder layers
pass one another nothing but their outputs (GPT-2, GPT-NeoX, Llama and the other transformers 5.x causal
LMs); the caller refuses a model whose layers ran other than once per forward.

The decoder layers are found through the adapter's attention modules (:func:`decoder_layers`): the
``ModuleList`` whose i-th entry holds layer i's attention module.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dofla.models.adapters.support import get_adapter


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order: the ``ModuleList`` whose i-th entry holds attention module i."""
    attention = get_adapter(model).attention_modules(model)
    for stack in model.modules():
        if isinstance(stack, nn.ModuleList) and len(stack) == len(attention) and all(
                any(m is a for m in layer.modules()) for layer, a in zip(stack, attention)):
            return list(stack)
    raise ValueError(f"model type {model.config.model_type!r} keeps its attention modules outside one list of "
                     "decoder layers, so its layers cannot be replayed; set budget.reuse_prefix=false")


def _keep(outputs: list, module, args, output) -> None:
    # a clone: a later layer or the head could change its input in place, and the record must not move
    outputs.append(_map(output, lambda t: t.detach().clone()))


def _map(output, fn):
    if torch.is_tensor(output):
        return fn(output)
    if isinstance(output, tuple):
        return tuple(_map(o, fn) for o in output)
    return output


@contextmanager
def recording(layers: list[nn.Module]) -> Iterator[list[list]]:
    """Yields ``records``: ``records[i]`` lists layer i's outputs, one per forward run inside the block."""
    records: list[list] = [[] for _ in layers]
    handles = [layer.register_forward_hook(functools.partial(_keep, records[i])) for i, layer in enumerate(layers)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def timing(layers: list[nn.Module]) -> Iterator[list[float]]:
    """Yields ``[seconds]``: the wall-clock seconds spent inside ``layers``' forwards run inside the block (the
    rest of a forward, the embeddings, the head and the loss, is a cost per forward, not per layer)."""
    spent, started = [0.0], [0.0]

    def start(module, args):
        started[0] = time.perf_counter()

    def stop(module, args, output):
        spent[0] += time.perf_counter() - started[0]

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(start),
                                               layer.register_forward_hook(stop))]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


def _first_tensor(output) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    return next((t for t in (_first_tensor(o) for o in output) if t is not None), None) \
        if isinstance(output, tuple) else None


def _replay(output, *args, **kwargs):
    hidden = args[0] if args else kwargs.get("hidden_states")
    recorded = _first_tensor(output)
    if torch.is_tensor(hidden) and recorded is not None and hidden.shape != recorded.shape:
        raise RuntimeError(f"a replayed layer got hidden states of shape {tuple(hidden.shape)} but its record has "
                           f"{tuple(recorded.shape)}: the record belongs to another input")
    return output


@contextmanager
def replaying(layers: list[nn.Module], outputs: list, start: int) -> Iterator[None]:
    """Inside the block layers 0..``start``-1 return ``outputs[i]`` (one forward's record) without running."""
    previous = [layer.__dict__.get("forward") for layer in layers[:start]]  # an instance's own forward, if any
    for layer, output in zip(layers[:start], outputs):
        layer.forward = functools.partial(_replay, output)
    try:
        yield
    finally:
        for layer, forward in zip(layers[:start], previous):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
