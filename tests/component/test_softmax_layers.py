"""Layers restored to exact softmax (allocation.softmax_layers): the restored student, its saving and
decoding, and the measurement that ranks layers by what restoring each does to the model's KL."""
from __future__ import annotations

import copy

import pytest
import torch

from dofla.dof.softmax_layers import (
    choose,
    copy_probe,
    copying_scores,
    greedy_restoration_kl,
    greedy_restoration_passkey,
    kv_bytes_per_token,
    passkey_prompts,
    probe_attention_errors,
    rank_layers,
    restoration_kl,
    restoration_passkey,
    retrieval_scores,
)
from dofla.eval import attention_errors
from dofla.models import convert, get_adapter, load_student, restorable_layers, restore_softmax, softmax_restored
from dofla.models.tiny import build_tiny_model
from dofla.train.distill import kl_reference


def _ids(batch=2, length=24, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _student(arch="llama", **kwargs):
    teacher = build_tiny_model(arch, seed=0)
    options = dict(feature_map="learned_prf", dims=[8, 8], chunk_size=4, seed=2) | kwargs
    return teacher, convert(copy.deepcopy(teacher), **options)


@torch.no_grad()
def _logits(model, ids):
    return model(ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
def test_every_layer_restored_is_the_teacher(arch):
    teacher, student = _student(arch)
    ids = _ids()
    assert (_logits(student, ids) - _logits(teacher, ids)).abs().max() > 1e-3  # linear: not the teacher
    restore_softmax(student, [0, 1])
    assert [a.mode for a in student.student_attentions()] == ["softmax", "softmax"]
    assert (_logits(student, ids) - _logits(teacher, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("attention", ["linear", "hybrid", "sliding_window"])
def test_restoring_a_layer_equals_converting_with_it_exact_and_survives_saving(tmp_path, attention):
    extra = {"attention": attention, "window": 3, "sinks": 1} if attention != "linear" else {}
    _, student = _student(**extra)
    _, converted = _student(softmax_layers=[1], **extra)
    converted.load_state_dict(student.state_dict(), strict=False)  # the same layer-0 features
    restore_softmax(student, [1])
    assert student.config.dofla["softmax_layers"] == [1]
    assert [a.mode for a in student.student_attentions()] == [attention, "softmax"]
    ids = _ids()
    assert torch.equal(_logits(student, ids), _logits(converted, ids))
    student.save_pretrained(tmp_path)
    assert "layers 1 exact softmax" in (tmp_path / "README.md").read_text()  # the model card says so
    reloaded = load_student(tmp_path)
    assert [a.mode for a in reloaded.student_attentions()] == [attention, "softmax"]
    assert torch.equal(_logits(reloaded, ids), _logits(student, ids))


def test_a_student_with_a_softmax_layer_decodes_like_its_parallel_forward():
    _, student = _student(softmax_layers=[0])
    prompt = _ids(batch=1, length=9)
    generated = student.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=256)
    tokens = prompt
    for _ in range(6):
        tokens = torch.cat([tokens, _logits(student, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_a_teachers_own_sliding_window_layer_is_never_restored_past_its_window(tmp_path, arch):
    """Gemma 2 alternates local and global layers; a teacher-local layer stays the teacher's window in
    every student, also when a saved student lists it among its softmax layers."""
    teacher = build_tiny_model(arch, seed=0)
    windows = get_adapter(teacher).geometry(teacher.config).layer_windows
    local = [i for i, w in enumerate(windows or []) if w is not None]
    assert local, "the tiny model should have a teacher sliding-window layer"
    for attention in ("linear", "sliding_window"):
        student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[8, 8], chunk_size=4,
                          attention=attention, window=3 if attention != "linear" else 0)
        assert restorable_layers(student) == [i for i in range(2) if i not in local]
        restore_softmax(student, local)
        assert all(student.student_attentions()[i].window == windows[i] for i in local)
        student.save_pretrained(tmp_path / attention)
        reloaded = load_student(tmp_path / attention)
        assert [a.window for a in reloaded.student_attentions()] == [a.window for a in student.student_attentions()]
        with softmax_restored(student, local[0]):
            assert student.student_attentions()[local[0]].window == windows[local[0]]


def test_softmax_restored_is_temporary():
    teacher, student = _student()
    ids = _ids()
    before, feature_map = _logits(student, ids), student.student_attentions()[0].feature_map
    with softmax_restored(student, 0):
        assert student.student_attentions()[0].mode == "softmax"
        inside = _logits(student, ids)
    assert student.student_attentions()[0].feature_map is feature_map
    assert torch.equal(_logits(student, ids), before) and not torch.allclose(inside, before)
    with softmax_restored(student, None):
        assert torch.equal(_logits(student, ids), before)


def test_restoration_kl_matches_a_plain_reference_and_ranks_a_broken_layer_first():
    teacher, student = _student()
    with torch.no_grad():  # layer 1's features made useless: restoring it must help most
        for p in student.student_attentions()[1].feature_map.parameters():
            p.mul_(0).add_(torch.randn_like(p) * 3)
    tokens = _ids(batch=3, length=16, seed=4)
    measured = restoration_kl(student, teacher, tokens, batch_size=2)
    assert set(measured["restored"]) == {0, 1}
    expected_base = kl_reference(_logits(student, tokens), _logits(teacher, tokens)).item()
    assert measured["base"] == pytest.approx(expected_base, rel=1e-3, abs=1e-7)
    for layer in (0, 1):
        alone = restore_softmax(copy.deepcopy(student), [layer])
        expected = kl_reference(_logits(alone, tokens), _logits(teacher, tokens)).item()
        assert measured["restored"][layer] == pytest.approx(expected, rel=1e-3, abs=1e-7)
    assert measured["restored"][1] < measured["base"]
    assert rank_layers(measured)[0] == 1 and choose(measured, 1) == [1]
    errors = probe_attention_errors(student, teacher, tokens)["attention_error"]
    assert list(errors.values()) == attention_errors(teacher, student, tokens, 2)
    assert choose({"attention_error": errors}, 1, "attention_error") == [1]  # the broken layer errs most
    assert [a.mode for a in student.student_attentions()] == ["linear", "linear"]  # measuring restored nothing


def test_choose_and_its_cost():
    measured = {"base": 1.0, "restored": {"0": 0.5, "1": 0.9, "2": 0.5}}
    assert rank_layers(measured) == [0, 2, 1]  # equal gains: the earlier layer first
    assert choose(measured, 2) == [0, 2]
    errors = {"attention_error": {"0": 0.2, "1": 0.7, "2": 0.4}}
    assert rank_layers(errors, "attention_error") == [1, 2, 0] and choose(errors, 1, "attention_error") == [1]
    with pytest.raises(ValueError, match="rank='error'"):
        rank_layers(errors, "error")
    with pytest.raises(ValueError, match="only 3 layers"):
        choose(measured, 4)
    geometry = get_adapter(build_tiny_model("llama")).geometry(build_tiny_model("llama").config)
    assert kv_bytes_per_token(2, geometry.num_kv_heads, geometry.head_dim) == 2 * 2 * geometry.num_kv_heads \
        * geometry.head_dim * 4


def test_restoring_is_refused_where_there_is_nothing_to_restore():
    teacher = build_tiny_model("llama", seed=0)
    exact = convert(copy.deepcopy(teacher), feature_map="softmax")
    assert restorable_layers(exact) == []
    with pytest.raises(ValueError, match="softmax_layers"):
        restore_softmax(exact, [0])
    _, student = _student()
    with pytest.raises(ValueError, match="outside 0..1"):
        restore_softmax(student, [2])
    assert [a.mode for a in student.student_attentions()] == ["linear", "linear"]


def test_the_greedy_choice_measures_each_step_with_the_earlier_layers_kept_exact():
    teacher = build_tiny_model("llama", seed=0, num_layers=4)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[8] * 4, chunk_size=4, seed=2)
    with torch.no_grad():  # layers 1 and 3 made useless
        for layer in (1, 3):
            for p in student.student_attentions()[layer].feature_map.parameters():
                p.mul_(0).add_(torch.randn_like(p) * 3)
    tokens = _ids(batch=3, length=16, seed=4)
    steps = greedy_restoration_kl(student, teacher, tokens, 3, batch_size=2)
    assert [a.mode for a in student.student_attentions()] == ["linear"] * 4  # measuring restored nothing
    chosen = [s["layer"] for s in steps]
    assert len(set(chosen)) == 3
    alone = restoration_kl(student, teacher, tokens, batch_size=2)["restored"]
    assert chosen[0] == min(alone, key=alone.get) and steps[0]["kl"] == pytest.approx(alone[chosen[0]], rel=1e-6)
    for s in range(1, 3):  # each step's KL is the plain KL of the student with the steps so far restored
        kept = restore_softmax(copy.deepcopy(student), chosen[:s + 1])
        expected = kl_reference(_logits(kept, tokens), _logits(teacher, tokens)).item()
        assert steps[s]["kl"] == pytest.approx(expected, rel=1e-3, abs=1e-7)
        # and no other layer added at that step would have done better
        for other in set(range(4)) - set(chosen[:s + 1]):
            rival = restore_softmax(copy.deepcopy(student), chosen[:s] + [other])
            assert kl_reference(_logits(rival, tokens), _logits(teacher, tokens)).item() >= steps[s]["kl"] - 1e-6
    assert set(chosen[:2]) == {1, 3}  # the two broken layers first
    # extended, not measured again: the stored steps are kept as given
    planted = [{"layer": 0, "kl": -1.0}]
    extended = greedy_restoration_kl(student, teacher, tokens, 2, batch_size=2, steps=planted)
    assert extended[0] == planted[0] and extended[1]["layer"] != 0
    assert rank_layers({"greedy": steps}, "kl_greedy") == chosen and choose({"greedy": steps}, 2, "kl_greedy") == \
        sorted(chosen[:2])
    with pytest.raises(ValueError, match="only 4 layers"):
        greedy_restoration_kl(student, teacher, tokens, 5)
    with pytest.raises(ValueError, match="has 3 steps"):
        choose({"greedy": steps}, 4, "kl_greedy")


def test_the_copy_probe_repeats_an_early_span_at_the_end():
    ids = _ids(length=64)
    probe, span = copy_probe(ids)
    assert span == 16 and torch.equal(probe[:, -16:], ids[:, 8:24]) and torch.equal(probe[:, :-16], ids[:, :-16])
    assert copy_probe(_ids(length=24))[1] == 5  # shrunk to fit
    with pytest.raises(ValueError, match="at least 14 tokens"):
        copy_probe(_ids(length=12))



def _answer_nats(model, prompts) -> float:
    """Plain reference: the mean over prompts of the answer tokens' summed cross entropy."""
    total = 0.0
    for prompt, answer in prompts:
        logits = _logits(model, torch.cat([prompt, answer], dim=1))[0, prompt.shape[1] - 1:-1]
        total += torch.nn.functional.cross_entropy(logits, answer[0], reduction="sum").item()
    return total / len(prompts)


def test_passkey_prompts_are_not_the_eval_probes_and_carry_their_answer(byte_tokenizer):
    prompts = passkey_prompts(byte_tokenizer, 200, 3, seed=0)
    assert len(prompts) == 3 and passkey_prompts(byte_tokenizer, 200, 3, seed=0)[1][0].equal(prompts[1][0])
    keys = [byte_tokenizer.decode(answer[0]) for _, answer in prompts]
    for (prompt, _), key in zip(prompts, keys):
        assert key[0] == " " and key[1:].isdigit() and len(key) == 6
        assert f"The pass key is{key}." in byte_tokenizer.decode(prompt[0])
        assert abs(prompt.shape[1] - 200) < 40
    gen = torch.Generator().manual_seed(0)  # the eval probe's keys, seed 0: drawn the same way
    evals = {int(torch.randint(10000, 100000, (1,), generator=gen)) for _ in range(10)}  # as passkey_trials
    assert evals.isdisjoint(int(k) for k in keys)


def test_the_passkey_choice_restores_the_layers_that_lower_the_answer_nll_most(byte_tokenizer):
    teacher = build_tiny_model("llama", seed=0, num_layers=3)
    student = convert(copy.deepcopy(teacher), attention="hybrid", window=8, sinks=1, feature_map="learned_prf",
                      dims=[8] * 3, chunk_size=32, seed=2)
    prompts = passkey_prompts(byte_tokenizer, 180, 2, seed=0)
    alone = restoration_passkey(student, prompts)
    assert alone["base"] == pytest.approx(_answer_nats(student, prompts), rel=1e-5)
    for layer, nats in alone["restored"].items():  # each equals the student with that layer exact
        assert nats == pytest.approx(_answer_nats(restore_softmax(copy.deepcopy(student), [layer]), prompts), rel=1e-5)
    steps = greedy_restoration_passkey(student, prompts, 2)
    assert [a.mode for a in student.student_attentions()] == ["hybrid"] * 3  # measuring restored nothing
    chosen = [s["layer"] for s in steps]
    assert chosen[0] == min(alone["restored"], key=alone["restored"].get)
    kept = restore_softmax(copy.deepcopy(student), chosen)
    assert steps[1]["nll"] == pytest.approx(_answer_nats(kept, prompts), rel=1e-5)
    rival = restore_softmax(copy.deepcopy(student), [chosen[0], ({0, 1, 2} - set(chosen)).pop()])
    assert _answer_nats(rival, prompts) >= steps[1]["nll"] - 1e-6
    all_exact = restore_softmax(copy.deepcopy(student), [0, 1, 2])  # every layer exact: the teacher
    assert _answer_nats(all_exact, prompts) == pytest.approx(_answer_nats(teacher, prompts), rel=1e-4)
    planted = [{"layer": 2, "nll": -1.0}]
    assert greedy_restoration_passkey(student, prompts, 2, steps=planted)[0] == planted[0]
    measured = {"passkey": {"greedy": steps}}
    assert rank_layers(measured, "passkey") == chosen and choose(measured, 2, "passkey") == sorted(chosen)
    with pytest.raises(ValueError, match="greedy choice has 2 steps"):
        choose(measured, 3, "passkey")

@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_retrieval_scores_equal_the_teachers_own_attention_weights(arch):
    """The score from captured q, k equals the one read off Hugging Face's eager attention weights:
    per layer, the strongest head's mean probability on the token after each copied token's source."""
    teacher = build_tiny_model(arch, seed=0)
    ids = _ids(batch=3, length=40)
    scores = retrieval_scores(teacher, ids, [0, 1], batch_size=2)["retrieval"]
    probe, span = copy_probe(ids)
    teacher.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = teacher(probe, output_attentions=True, use_cache=False).attentions
    queries = torch.arange(40 - span, 39)
    targets = queries - (40 - span) + 8 + 1
    per_head = copying_scores(teacher, ids, batch_size=2)
    for i in (0, 1):
        heads = attentions[i][:, :, queries, targets].mean(-1).mean(0)  # (B, H, Q) -> per head
        assert per_head[i].tolist() == pytest.approx(heads.tolist(), abs=1e-5)
        assert scores[i] == pytest.approx(float(heads.max()), abs=1e-5)
        assert 0 < scores[i] < 1
    measured = {"retrieval": {str(i): v for i, v in scores.items()}}
    assert choose(measured, 1, "retrieval") == [max(scores, key=scores.get)]
