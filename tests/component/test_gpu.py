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


def test_a_layer_loss_step_synchronises_with_the_host_once_on_cuda():
    """CUDA's own sync detector agrees with the CPU count (tests/unit/test_host_syncs.py): the softmax
    loss's forward and backward wait for the device once, for the stabiliser's fast-path flags."""
    import warnings

    from dofla.train.losses import softmax_loss

    g = torch.Generator().manual_seed(0)
    log_q, log_k, q, k = (torch.randn(2, 2, 300, 8, generator=g).cuda() for _ in range(4))
    log_q.requires_grad_()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            softmax_loss(log_q, log_k, q, k).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
