"""Long-context measurements on a tiny random model: window mass, loss by position, passkey prompts."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.eval import heldout_loss
from dofla.eval.longctx import (
    loss_by_position,
    mass_outside_window,
    outside_window_mask,
    answer_nll,
    passkey_probe,
    passkey_prompt,
)
from dofla.models import capture_qkv
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama", seed=0)


def test_outside_window_mask_small_case():
    mask = outside_window_mask(5, window=2, sinks=1)
    # row 4 sees keys 0..4; window covers 3, 4; sink covers 0: outside = {1, 2}
    assert mask[4].tolist() == [False, True, True, False, False]
    assert not mask[:2].any()  # rows 0, 1 see only window and sink


def test_mass_outside_window_matches_a_per_row_loop(llama):
    tokens = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    window, sinks = 3, 1
    got = mass_outside_window(llama, tokens, window, sinks)
    for layer, (q, k, _) in enumerate(capture_qkv(llama, tokens)):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        total = 0.0
        for b in range(tokens.shape[0]):
            for h in range(q.shape[1]):
                for i in range(tokens.shape[1]):
                    logits = q[b, h, i] @ k[b, h, : i + 1].T / math.sqrt(q.shape[-1])
                    p = torch.softmax(logits, dim=-1)
                    total += sum(p[j].item() for j in range(sinks, i - window + 1)) / q.shape[1]
        assert got[layer] == pytest.approx(total / tokens.numel(), rel=1e-5)


def test_mass_outside_window_is_zero_when_the_window_covers_everything(llama):
    tokens = torch.randint(0, 250, (1, 10), generator=torch.Generator().manual_seed(1))
    assert mass_outside_window(llama, tokens, window=10) == [0.0] * len(capture_qkv(llama, tokens))
    assert all(0 < m < 1 for m in mass_outside_window(llama, tokens, window=1))


def test_loss_by_position_buckets_average_to_the_heldout_loss(llama):
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(2))
    edges = [1, 5, 9, 17]
    buckets = loss_by_position(llama, tokens, edges)
    sizes = [4, 4, 8]
    pooled = sum(b * n for b, n in zip(buckets, sizes)) / sum(sizes)
    assert pooled == pytest.approx(heldout_loss(llama, tokens), rel=1e-5)
    assert math.isnan(loss_by_position(llama, tokens, [1, 17, 40])[1])
    with pytest.raises(ValueError, match="increasing"):
        loss_by_position(llama, tokens, [5, 1])


def test_passkey_prompt_holds_the_key_at_about_the_length():
    tokenizer = build_byte_tokenizer()
    ids = passkey_prompt(tokenizer, 600, 12345, depth=0.5)
    text = tokenizer.decode(ids[0])
    assert "The pass key is 12345." in text and text.endswith("The pass key is")
    assert 500 <= ids.shape[1] <= 600


def test_passkey_probe_runs_greedy_generation_and_scores_the_answer(llama):
    scores = passkey_probe(llama, build_byte_tokenizer(), [300, 200], trials=2)
    assert set(scores) == {300, 200}
    for accuracy, nll in scores.values():
        assert 0.0 <= accuracy <= 1.0 and nll > 0.0


def test_answer_nll_is_the_sum_of_each_answer_token_read_after_its_own_prefix(llama):
    gen = torch.Generator().manual_seed(3)
    prompt, answer = torch.randint(0, 256, (1, 40), generator=gen), torch.randint(0, 256, (1, 6), generator=gen)
    step_by_step = 0.0
    for i in range(answer.shape[1]):  # one forward per answer token: the plain reference
        logits = llama(torch.cat([prompt, answer[:, :i]], dim=1)).logits[0, -1]
        step_by_step -= torch.log_softmax(logits, -1)[answer[0, i]].item()
    assert answer_nll(llama, prompt, answer) == pytest.approx(step_by_step, rel=1e-4)
