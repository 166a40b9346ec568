"""``train.compile``: the layer losses under torch.compile give the eager values and gradients, a short
layer training lands where the eager one does, and compiling changes no artifact key. Real compiles
(inductor, the machine's C++ compiler): the first call of each takes seconds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dofla.config import RunConfig
from dofla.feature_maps import build_feature_map
from dofla.stages import keys
from dofla.train.layerwise import LayerTrainConfig, layer_loss, train_layer
from dofla.validate_training import cxx_compiler

from .test_train import realistic_qk

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")


def loss_and_gradient(cfg: LayerTrainConfig, outlier: bool):
    q, k = realistic_qk(seqs=2, length=150)
    if outlier:  # a key far above the rest: the stabiliser's guarded path runs in some blocks
        k[:, :, 70] *= 6.0
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(3))
    fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
    value = layer_loss(fm, q, k, cfg, v)
    value.backward()
    return value.detach(), torch.cat([p.grad.flatten() for p in fm.parameters()])


# Each new graph compiles for 40-80 s on two cores from a cold cache (a fresh CI machine): every compile
# test is in the long tier (make test-long, make test-all, and CI when its clock allows).
LONG = pytest.mark.long


@pytest.mark.parametrize("loss,window,sinks", [pytest.param("softmax", 0, 0, marks=LONG),
                                               pytest.param("softmax", 16, 2, marks=LONG),
                                               pytest.param("l2", 0, 0, marks=LONG),
                                               pytest.param("output", 16, 2, marks=LONG)])
@pytest.mark.parametrize("outlier", [False, True])
def test_a_compiled_layer_loss_and_its_gradient_equal_the_eager_ones(loss, window, sinks, outlier):
    cfg = LayerTrainConfig(loss=loss, window=window, sinks=sinks)
    eager = loss_and_gradient(cfg, outlier)
    compiled = loss_and_gradient(dataclasses.replace(cfg, compile=True), outlier)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-6)


@LONG
def test_a_compiled_layer_training_lands_where_the_eager_one_does():
    q, k = realistic_qk()
    results = {}
    for compile in (False, True):
        fm = build_feature_map("learned_prf", 3, 16, 16, seed=0)
        cfg = LayerTrainConfig(steps=30, batch_size=4, eval_every=10, warmup_steps=4, compile=compile)
        results[compile] = train_layer(fm, q, k, cfg)
    eager, compiled = results[False], results[True]
    assert compiled.final_heldout_loss < compiled.initial_heldout_loss
    assert compiled.initial_heldout_loss == pytest.approx(eager.initial_heldout_loss, rel=1e-5)
    assert compiled.final_heldout_loss == pytest.approx(eager.final_heldout_loss, rel=1e-3)
    # 30 Adam steps turn float-rounding differences of the gradient (equal to 1e-4 above) into up to
    # ~1e-2 on a weight whose gradient sits near zero: Adam divides by its running magnitude
    for name, value in eager.state_dict.items():
        torch.testing.assert_close(compiled.state_dict[name], value, rtol=2e-2, atol=1e-3)


def test_compiling_changes_no_artifact_key():
    plain = RunConfig()
    compiled = dataclasses.replace(plain, train=dataclasses.replace(plain.train, compile=True))
    assert keys.layer_meta(compiled, "cache") == keys.layer_meta(plain, "cache")
    assert keys.student_settings(compiled, "cache", [8]) == keys.student_settings(plain, "cache", [8])
