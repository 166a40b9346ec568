"""Long-context measurements on a tiny random model: window mass, loss by position, passkey prompts."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.eval import heldout_loss
from dofla.eval.metrics import next_token_nll, next_token_nll_reference
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


@pytest.mark.parametrize("shape", [(1, 2, 3), (3, 17, 259), (2, 64, 1031)])
def test_next_token_nll_over_contiguous_rows_is_the_transposed_cross_entropy(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(shape, generator=generator, dtype=torch.float64) * 8  # peaked rows, as a trained head's
    tokens = torch.randint(0, shape[2], shape[:2], generator=generator)
    fast = next_token_nll(logits.double(), tokens)  # float32 inside, as both read the logits
    assert fast.shape == (shape[0], shape[1] - 1)
    torch.testing.assert_close(fast, next_token_nll_reference(logits, tokens), rtol=1e-5, atol=1e-5)
    picked = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(fast, picked, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "student"])
def test_answer_nll_is_the_sum_of_each_answer_token_read_after_its_own_prefix(arch, llama):
    """Every family, and a converted student (a window and a delta state per head), computes only the
    answer's logits and gives what one whole forward per answer token gives."""
    from dofla.models import convert
    from dofla.models.plan import HeadPlan, StudentPlan

    if arch == "student":
        plan = StudentPlan([(HeadPlan(window=8, sinks=2), HeadPlan(state="delta", M=8))] * 2)
        model = convert(build_tiny_model("llama", seed=0), feature_map="hedgehog", plan=plan).eval()
    else:
        model = llama if arch == "llama" else build_tiny_model(arch, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompt, answer = torch.randint(0, 256, (1, 40), generator=gen), torch.randint(0, 256, (1, 6), generator=gen)
    step_by_step = 0.0
    with torch.no_grad():
        for i in range(answer.shape[1]):  # one forward per answer token: the plain reference
            logits = model(torch.cat([prompt, answer[:, :i]], dim=1)).logits[0, -1]
            step_by_step -= torch.log_softmax(logits, -1)[answer[0, i]].item()
        assert answer_nll(model, prompt, answer) == pytest.approx(step_by_step, rel=1e-4)


def test_per_sequence_losses_are_each_sequences_own_and_average_to_the_pooled_ones(llama):
    from dofla.eval.longctx import losses_by_position
    from dofla.eval.metrics import heldout_losses

    tokens = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(3))
    per_seq = heldout_losses(llama, tokens, batch_size=2)
    alone = [heldout_loss(llama, tokens[i : i + 1]) for i in range(3)]
    assert per_seq.tolist() == pytest.approx(alone, rel=1e-6)
    assert per_seq.mean().item() == pytest.approx(heldout_loss(llama, tokens), rel=1e-6)
    edges = [1, 5, 17]
    table = losses_by_position(llama, tokens, edges, batch_size=2)
    assert table.shape == (3, 2)
    assert table[1].tolist() == pytest.approx(loss_by_position(llama, tokens[1:2], edges), rel=1e-6)


def test_passkey_recall_read_from_one_forward_agrees_with_greedy_decoding(llama):
    from dofla.eval.longctx import passkey_case, passkey_trials, recalled_by_decoding

    tokenizer = build_byte_tokenizer()
    fast = passkey_trials(llama, tokenizer, 120, 4, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    for t, (recalled, nll) in enumerate(fast):
        passkey, ids, key = passkey_case(tokenizer, 120, gen, depth=(t + 0.5) / 4)
        assert recalled == recalled_by_decoding(llama, tokenizer, ids, passkey)
        assert nll == pytest.approx(answer_nll(llama, ids, key), rel=1e-5)


def test_recall_from_the_argmax_decides_only_what_the_argmax_decides():
    from dofla.eval.longctx import recalled_from_argmax

    tokenizer = build_byte_tokenizer()
    answer = tokenizer(" 12345", add_special_tokens=False).input_ids
    letter = tokenizer("x", add_special_tokens=False).input_ids[0]
    one = tokenizer("1", add_special_tokens=False).input_ids[0]
    assert recalled_from_argmax(tokenizer, 12345, answer, answer) is True
    assert recalled_from_argmax(tokenizer, 12345, answer, answer[:3] + [letter] + answer[4:]) is False
    # "1" without the space could still begin " 12345" once decoded and stripped: decoding decides
    assert recalled_from_argmax(tokenizer, 12345, answer, [one] + answer[1:]) is None
