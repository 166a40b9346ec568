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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_the_fla_kernel_matches_the_pytorch_chunked_form_in_each_precision(dtype, tol):
    """fla's kernel itself (it takes fp32 inputs since 0.4), fed this precision, against the PyTorch
    chunked form in fp64 on the same rounded inputs: outputs and the final state."""
    pytest.importorskip("fla")
    from dofla.attention.delta import DeltaState, delta_rule_chunked
    from dofla.attention.delta_backend import fla_kernel
    from tests.unit.test_delta_rule import inputs

    q, k, v, log_alpha, beta = (t.cuda() for t in inputs(b=2, h=4, t=300, m=64, dv=64, alpha=(0.0, 0.1)))
    start = 0.1 * torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float64)
    time_major = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  (B, H, T, ·) -> (B, T, H, ·)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out, state = fla_kernel()(time_major(q), time_major(k), time_major(v), time_major(log_alpha.float()),
                              time_major(beta.to(dtype)), scale=1.0, initial_state=start.float(),
                              output_final_state=True)
    assert out.dtype == dtype
    ref, ref_state = delta_rule_chunked(q.double(), k.double(), v.double(), log_alpha, beta.to(dtype).double(),
                                        state=DeltaState(start, 0))
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(state.double(), ref_state.S, rtol=tol, atol=tol)
