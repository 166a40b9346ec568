"""Held-out loss and per-layer attention error on tiny models."""
from __future__ import annotations

import copy
import math

import torch

from dofla.eval import attention_errors, heldout_loss, layer_attention_error, perplexity
from dofla.feature_maps import build_feature_map
from dofla.models import convert


def test_heldout_loss_matches_manual_computation(tiny_model):
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny_model(tokens).logits[:, :-1]
        manual = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   tokens[:, 1:].reshape(-1)).item()
    assert abs(heldout_loss(tiny_model, tokens, batch_size=2) - manual) < 1e-5
    assert math.isclose(perplexity(tiny_model, tokens, batch_size=3), math.exp(manual), rel_tol=1e-5)


def test_attention_error_is_zero_for_softmax_and_positive_for_performer(tiny_model):
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = convert(copy.deepcopy(tiny_model), feature_map="softmax")
    assert max(attention_errors(tiny_model, exact, tokens)) < 1e-6
    performer = convert(copy.deepcopy(tiny_model), feature_map="performer", dims=[4, 4])
    errors = attention_errors(tiny_model, performer, tokens)
    assert len(errors) == 2 and min(errors) > 1e-3
    batched = attention_errors(tiny_model, performer, tokens, batch_size=2)
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(errors, batched))


def test_layer_attention_error_handles_gqa_and_shrinks_with_more_features():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 32, 16, generator=g) * 0.5 for h in (4, 2, 2))
    errors = [layer_attention_error(build_feature_map("performer", 4, 16, m, seed=1), q, k, v)
              for m in (4, 4096)]
    assert errors[1] < errors[0] and errors[1] < 0.1
