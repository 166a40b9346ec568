"""CUDA paths of the evaluation protocol, the measured resources and ``train.compile`` (skipped where no
CUDA device is visible: marker ``gpu``; ``dofla-gpucheck`` runs them)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dofla.eval.task_finetune import finetune_step
from dofla.measure import peak_memory
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.precision import resolve

from .test_finetune_protocol_resume import rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_micro_batched_task_fine_tune_step_on_cuda_matches_the_cpu(precision):
    from dofla.precision import configure_matmul

    cpu = convert(build_tiny_model("llama", seed=0), feature_map="learned_prf").eval()
    gpu = copy.deepcopy(cpu).cuda()
    data = rows(6)
    configure_matmul(precision)
    try:
        losses = [finetune_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3), data, 16, micro, precision)
                  for m, micro in ((cpu, None), (gpu, 2))]
    finally:
        configure_matmul("fp32")
    tolerance = {"fp32": 1e-5, "tf32": 1e-2, "bf16": 3e-2}[precision]
    torch.testing.assert_close(losses[1].cpu(), losses[0], rtol=tolerance, atol=tolerance)
    assert all(p.dtype == torch.float32 for p in gpu.parameters())


def test_the_measured_cuda_peak_is_the_allocators_and_nests():
    device = torch.device("cuda")
    with peak_memory(device) as outer:
        with peak_memory(device) as inner:
            block = torch.empty(2**26, dtype=torch.uint8, device=device)  # 64 MiB
            del block
        small = torch.empty(2**20, dtype=torch.uint8, device=device)
        del small
    assert inner["kind"] == "cuda" and 2**26 <= inner["bytes"] < 2**26 + 2**22
    assert outer["bytes"] >= inner["bytes"]


def test_precision_auto_is_tf32_on_a_gpu():
    assert resolve("auto", "auto") == "tf32" and resolve("auto", "cuda:0") == "tf32"
    assert resolve("auto", "cpu") == "fp32" and resolve("bf16", "cuda") == "bf16"


def test_a_compiled_layer_loss_on_cuda_equals_the_eager_one():
    from dofla.feature_maps import build_feature_map
    from dofla.train.layerwise import LayerTrainConfig, layer_loss

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 150, 16, generator=g).cuda() for _ in range(2))
    results = []
    for compile in (False, True):
        fm = build_feature_map("learned_prf", 3, 16, 16, seed=0).cuda()
        value = layer_loss(fm, q, k, dataclasses.replace(LayerTrainConfig(loss="softmax"), compile=compile))
        value.backward()
        results.append((value.detach(), torch.cat([p.grad.flatten() for p in fm.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)
