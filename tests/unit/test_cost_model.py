"""The cost model's counted FLOPs against its analytic references, on tiny configs (seconds)."""
import pytest
import torch

from studies.cost_model import (ElementCounter, fake_model, flop_counter, layer_step_count, layer_step_reference,
                                   teacher_config, teacher_flops, teacher_flops_reference)
from dofla.feature_maps import build_layer_feature_map
from dofla.models.tiny import TINY_ARCHITECTURES, TINY_FAMILIES, TINY_VOCAB
from dofla.train.layerwise import LayerTrainConfig, layer_loss

TOLERANCE = 0.01  # both count the same matmuls; only a missed or extra op can move them apart


def tiny_config(arch: str, layers: int = 3):
    _, config = TINY_FAMILIES[arch](layers)
    config.vocab_size = TINY_VOCAB
    return config


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_teacher_forward_count_matches_two_params_plus_attention(arch):
    model, mode = fake_model(tiny_config(arch))
    counted = teacher_flops(model, mode, seq_len=96, stream=False)
    assert counted == pytest.approx(teacher_flops_reference(model, 96), rel=TOLERANCE)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_streaming_teacher_skips_the_lm_head_and_last_layer_tail(arch):
    model, mode = fake_model(tiny_config(arch))
    full, stream = (teacher_flops(model, mode, 96, stream=s) for s in (False, True))
    lm_head = 2 * model.get_output_embeddings().weight.numel() * 96
    assert 0.5 * (full - lm_head) < stream < full - lm_head


@pytest.mark.parametrize("seq_len", [128, 200])  # 200: a partial last key block
def test_layer_step_count_matches_reference(seq_len):
    counted = layer_step_count(num_heads=3, head_dim=16, features=8, seq_len=seq_len).flops
    assert counted == pytest.approx(layer_step_reference(3, 16, 8, seq_len), rel=TOLERANCE)


def test_one_head_times_heads_equals_counting_all_heads():
    heads, d, m, length = 3, 16, 8, 160
    fmap = build_layer_feature_map("learned_prf", heads, d, m, seed=0)
    q, k = torch.randn(1, heads, length, d), torch.randn(1, heads, length, d)
    with flop_counter() as counter:
        layer_loss(fmap, q, k, LayerTrainConfig()).backward()
    assert layer_step_count(heads, d, m, length).flops == pytest.approx(counter.get_total_flops(), rel=TOLERANCE)


def test_elementwise_work_grows_quadratically_with_context():
    short, long = (layer_step_count(1, 16, 8, n).elements for n in (256, 512))
    assert 3.0 < long / short < 4.2


def test_element_counter_skips_views_and_matmuls():
    a = torch.randn(8, 8)
    with ElementCounter() as counter:
        (a @ a).t().exp()
    assert counter.elements == 64


def test_unknown_model_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown model 'gpt3'"):
        teacher_config("gpt3")
