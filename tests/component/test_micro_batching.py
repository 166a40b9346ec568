"""Micro-batching (``train.micro_batch_size``): the accumulated gradient of the micro-batches is the
full batch's (fp64, every layerwise loss), and whole trainings (layerwise from the cache, streamed,
end to end) land where the full-batch ones do."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dofla.feature_maps import build_feature_map
from dofla.models import convert
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train.direct import train_direct
from dofla.train.layerwise import LayerTrainConfig, layer_loss, mean_over_rows, train_layer
from dofla.train.step import Accumulator, micro_batches
from dofla.train.losses import layerwise_losses
from dofla.train.stream import train_layers_streaming

from .test_stream import heldout, stream
from .test_train import realistic_qk


def gradient(feature_map, q, k, v, cfg):
    optimizer = torch.optim.SGD(feature_map.parameters(), lr=0.0)
    step = Accumulator(optimizer)
    for part, share in micro_batches(torch.arange(q.shape[0]), cfg):
        step.add(layer_loss(feature_map, q[part], k[part], cfg, v[part]), share)
    total = step.step("test", skip_nonfinite=False)
    return total, torch.cat([p.grad.flatten() for p in feature_map.parameters()])


@pytest.mark.parametrize("loss", [name for name in layerwise_losses() if mean_over_rows(name)])
@pytest.mark.parametrize("window", [0, 8])
def test_micro_batch_gradients_equal_the_full_batch_in_fp64(loss, window):
    q, k = (t.double() for t in realistic_qk(seqs=6, length=24))
    v = torch.randn(k.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    fm = build_feature_map("learned_prf", 3, 16, 16, seed=0).double()
    full = LayerTrainConfig(loss=loss, window=window)
    reference = gradient(fm, q, k, v, full)
    assert reference[1].abs().max() > 0
    for micro in (1, 2, 4):  # 4: micro-batches of unequal size (4 + 2)
        total, grad = gradient(fm, q, k, v, dataclasses.replace(full, micro_batch_size=micro))
        torch.testing.assert_close(total, reference[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, reference[1], rtol=1e-10, atol=1e-13)


def test_a_layer_trained_in_micro_batches_lands_where_the_full_batch_one_does():
    q, k = (t.double() for t in realistic_qk())  # fp64: Adam would amplify fp32 rounding in near-zero gradients
    maps = [build_feature_map("learned_prf", 3, 16, 16, seed=0).double() for _ in range(2)]
    cfg = LayerTrainConfig(steps=20, batch_size=4, eval_every=5, warmup_steps=2)
    full = train_layer(maps[0], q, k, cfg)
    micro = train_layer(maps[1], q, k, dataclasses.replace(cfg, micro_batch_size=1))
    assert micro.final_heldout_loss == pytest.approx(full.final_heldout_loss, rel=1e-10)
    for name, value in full.state_dict.items():
        torch.testing.assert_close(micro.state_dict[name], value, rtol=1e-8, atol=1e-10)


def test_a_streamed_run_in_micro_batches_lands_where_the_full_batch_one_does():
    tokenizer = build_byte_tokenizer()
    teacher = build_tiny_model("llama", seed=0, num_layers=3)
    cfg = LayerTrainConfig(batch_size=4, warmup_steps=2, eval_every=5)
    results, maps = [], []
    for micro in (None, 1):
        maps.append([build_feature_map("learned_prf", 4, 16, 16, seed=i) for i in range(3)])
        results.append(train_layers_streaming(teacher, stream(tokenizer, batch_size=4), maps[-1], [0, 1, 2],
                                              dataclasses.replace(cfg, micro_batch_size=micro),
                                              heldout(teacher, tokenizer), num_tokens=10 * 128, progress=False))
    assert results[0].tokens == results[1].tokens == 10 * 128
    for i in range(3):
        full, micro = results[0].summaries[i], results[1].summaries[i]
        assert [c["loss"] for c in micro["curve"]] == pytest.approx([c["loss"] for c in full["curve"]], rel=1e-4)
        for (name, a), b in zip(maps[0][i].state_dict().items(), maps[1][i].state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_direct_training_in_micro_batches_lands_where_the_full_batch_one_does():
    student = convert(build_tiny_model("llama"), feature_map="learned_prf", dims=[8, 8])
    tokens = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(0))
    cfg = LayerTrainConfig(steps=6, batch_size=4, warmup_steps=2)
    students = [copy.deepcopy(student), copy.deepcopy(student)]
    full = train_direct(students[0], tokens, cfg)
    micro = train_direct(students[1], tokens, dataclasses.replace(cfg, micro_batch_size=2))
    assert [c["loss"] for c in micro] == pytest.approx([c["loss"] for c in full], rel=1e-5)
    for (name, a), b in zip(students[0].state_dict().items(), students[1].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
