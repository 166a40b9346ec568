"""CUDA paths (skipped where no CUDA device is visible: marker ``gpu``)."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.models import convert
from dofla.models.tiny import build_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("attention", ["linear", "hybrid"])
def test_student_on_cuda_matches_cpu_and_decodes(attention):
    cpu = convert(build_tiny_model("llama", seed=0), feature_map="learned_prf", dims=[8, 8], attention=attention,
                  window=4 if attention == "hybrid" else 0)
    gpu = copy.deepcopy(cpu).to("cuda")
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = cpu(ids, use_cache=False).logits
        got = gpu(ids.cuda(), use_cache=False).logits.cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    out = gpu.generate(ids[:1, :8].cuda(), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.device.type == "cuda" and out.shape == (1, 16)
