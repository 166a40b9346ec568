"""Which layers to keep as exact softmax: ranked by what restoring each one does to the model's KL.

A layer's attention error does not say how much the model's predictions depend on it (errors
compound or wash out through the layers after it), so the ranking is measured on the model: for
each linear (or hybrid) layer i, the student with layer i alone restored to exact softmax runs on
probe sequences of the training text, and its KL(teacher ‖ student) on the next-token
distributions is compared with the student's own. The k layers whose restoration lowers the KL
most are kept exact (:func:`dofla.models.restore_softmax`). Restoring one layer at a time ranks
the layers independently; the gains of several restored together need not add up.

Cost: per probe batch one teacher forward and L + 1 student forwards (the teacher's logits live
one batch at a time, never stored). Kept layers cost a KV cache when decoding:
:func:`kv_bytes_per_token` per token of context.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from dofla.models import softmax_restored
from dofla.train.distill import kl_to_teacher


@torch.no_grad()
def restoration_kl(student, teacher, tokens: torch.Tensor, batch_size: int = 2,
                   layers: list[int] | None = None) -> dict:
    """KL(teacher ‖ student) per predicted token over ``tokens`` (S, L), as the student is and with
    each layer of ``layers`` (default: every layer with a feature map) restored to softmax alone.

    Returns {"base": float, "restored": {layer: float}}; both are means over all S·L tokens.
    """
    device = next(student.parameters()).device
    attentions = student.student_attentions()
    if layers is None:
        layers = [i for i, attn in enumerate(attentions) if attn.feature_map is not None]
    sums = dict.fromkeys([None, *layers], 0.0)
    count = 0
    batches = tokens.split(batch_size)
    with tqdm(total=len(batches) * len(sums), desc="softmax layers: KL per restored layer", unit="forward",
              leave=False) as progress:
        for batch in batches:
            batch = batch.to(device)
            target = teacher(input_ids=batch, use_cache=False).logits
            for layer in sums:
                with softmax_restored(student, layer):
                    logits = student(input_ids=batch, use_cache=False).logits
                sums[layer] += kl_to_teacher(logits, target).item() * batch.numel()
                progress.update()
            count += batch.numel()
    return {"base": sums[None] / count, "restored": {i: sums[i] / count for i in layers}}


def rank_layers(measured: dict) -> list[int]:
    """Layers in the order of how much restoring each lowers the KL (largest gain first; ties by index)."""
    restored = {int(i): kl for i, kl in measured["restored"].items()}
    return sorted(restored, key=lambda i: (restored[i], i))


def choose(measured: dict, k: int) -> list[int]:
    """The ``k`` layers whose restoration lowers the KL most, in layer order."""
    ranking = rank_layers(measured)
    if k > len(ranking):
        raise ValueError(f"{k} softmax layers were asked for but only {len(ranking)} layers have linear features")
    return sorted(ranking[:k])


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int = 4) -> int:
    """Decoding memory the kept softmax layers add per token of context: a key and a value per KV head."""
    return layers * 2 * kv_heads * head_dim * bytes_per_value
