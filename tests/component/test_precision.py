"""``precision=bf16``: the layer losses and their gradients, end-to-end losses, a short training run
and the KL stay within stated tolerances of fp32 (on the CPU's bfloat16 autocast); the setting
enters the artifact keys only when it is not the legacy fp32."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dofla.config import RunConfig
from dofla.feature_maps import build_feature_map
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.precision import autocast, teacher_dtype
from dofla.stages import keys
from dofla.train.distill import kl_to_teacher
from dofla.train.layerwise import LayerTrainConfig, layer_loss, train_layer
from dofla.train.losses import layerwise_losses

from .test_train import realistic_qk


def loss_and_gradient(precision, loss):
    q, k = realistic_qk(seqs=4, length=32)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(3))
    fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
    value = layer_loss(fm, q, k, LayerTrainConfig(loss=loss, precision=precision), v)
    value.backward()
    return value.detach(), torch.cat([p.grad.flatten() for p in fm.parameters()])


@pytest.mark.parametrize("loss", layerwise_losses())
def test_bf16_layer_losses_and_gradients_stay_close_to_fp32(loss):
    value32, grad32 = loss_and_gradient("fp32", loss)
    value16, grad16 = loss_and_gradient("bf16", loss)
    assert value16.dtype == torch.float32 and torch.isfinite(value16)
    assert value16.item() == pytest.approx(value32.item(), rel=0.03)  # bf16 keeps ~3 significant digits
    cosine = torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)
    assert cosine > 0.98 and grad16.norm() == pytest.approx(grad32.norm().item(), rel=0.1)


def test_a_bf16_layer_training_lands_near_the_fp32_one():
    q, k = realistic_qk()
    results = {}
    for precision in ("fp32", "bf16"):
        fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
        cfg = LayerTrainConfig(steps=40, batch_size=4, eval_every=10, warmup_steps=4, precision=precision)
        results[precision] = train_layer(fm, q, k, cfg)
        assert all(p.dtype == torch.float32 for p in fm.parameters())  # fp32 master weights
    full, half = results["fp32"], results["bf16"]
    assert half.final_heldout_loss < half.initial_heldout_loss
    # the gain over the initial loss agrees within 10 %
    assert (half.initial_heldout_loss - half.final_heldout_loss) == pytest.approx(
        full.initial_heldout_loss - full.final_heldout_loss, rel=0.1)


def test_bf16_student_losses_and_kl_stay_close_to_fp32():
    teacher = build_tiny_model("llama", seed=0).eval()
    student = convert(build_tiny_model("llama", seed=0), feature_map="learned_prf", dims=[8, 8]).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    values = {}
    for precision in ("fp32", "bf16"):
        with torch.no_grad(), autocast(precision, "cpu"):
            s = student(input_ids=ids, labels=ids, use_cache=False)
            t = teacher(input_ids=ids, use_cache=False).logits
        values[precision] = (s.loss.float().item(), kl_to_teacher(s.logits, t).item())
    assert values["bf16"][0] == pytest.approx(values["fp32"][0], rel=0.01)
    assert values["bf16"][1] == pytest.approx(values["fp32"][1], rel=0.25, abs=2e-3)


def test_precision_enters_the_keys_only_when_not_fp32():
    cfg = RunConfig()
    half = dataclasses.replace(cfg, precision="bf16")
    assert "precision" not in keys.layer_meta(cfg, "k") and keys.layer_meta(half, "k")["precision"] == "bf16"
    assert keys.distill_settings(cfg, {}) != keys.distill_settings(half, {})
    assert "teacher_dtype" not in keys.cache_fields(cfg, "data")
    assert keys.cache_fields(half, "data")["teacher_dtype"] == "bfloat16"  # bf16 teacher activations
    assert teacher_dtype("bf16", "float16") == "float16" and teacher_dtype("fp32", "float32") == "float32"
