"""Model-level distillation (``distill=kl``): the KL against its plain reference, micro-batching,
what trains, that it learns, resume, running out of text, and the stage's reuse."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dofla.errors import DoflaError
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train.direct import RandomRows
from dofla.train.distill import (DistillSchedule, accumulate, attention_projections,
                                 kl_reference, kl_to_teacher, prepare_trainable, train_kl)

SCHEDULE = DistillSchedule(steps=12, micro_batch_size=4, lr=1e-2, feature_lr=1e-2, warmup_steps=2,
                           log_every=3, checkpoint_every=4)


def tokens(rows=16, length=32, seed=0):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def pair(arch="llama", noise=0.3):
    """A tiny teacher and a linear student whose attention outputs are perturbed, so KL starts > 0."""
    teacher = build_tiny_model(arch, seed=0).eval()
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[8, 8])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attention_projections(student):
            if p.ndim == 2:
                p.add_(noise * torch.randn(p.shape, generator=generator))
    return teacher, student


def mean_kl(student, teacher, ids):
    with torch.no_grad():
        return kl_to_teacher(student(input_ids=ids, use_cache=False).logits,
                             teacher(input_ids=ids, use_cache=False).logits).item()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_equals_torch_kl_div(temperature):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 7, 50, generator=g) * 3, torch.randn(2, 7, 50, generator=g) * 3
    assert kl_to_teacher(s, t, temperature).item() == pytest.approx(kl_reference(s, t, temperature).item(), rel=1e-5)
    assert kl_to_teacher(t, t, temperature).item() == pytest.approx(0.0, abs=1e-6)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 3:] = True
    assert kl_to_teacher(s, t, temperature, mask).item() == pytest.approx(
        kl_reference(s[1, 3:], t[1, 3:], temperature).item(), rel=1e-5)


def test_micro_batches_accumulate_the_full_batch_gradient():
    teacher, student = pair()
    teacher, student = teacher.double(), student.double()
    model, groups = prepare_trainable(student, ["features", "attention"])
    params = [p for _, ps in groups for p in ps]
    batch = tokens(rows=6)
    grads = []
    for micro in (6, 2, 3):
        model.zero_grad(set_to_none=True)
        accumulate(model, teacher, batch, dataclasses.replace(SCHEDULE, micro_batch_size=micro))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert grads[0].abs().max() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("train, expected", [
    (["features"], "features"), (["attention"], "attention"), (["lora"], "lora")])
def test_only_what_is_named_trains(train, expected):
    teacher, student = pair("gpt2")
    model, groups = prepare_trainable(student, train)
    assert [name for name, _ in groups] == [expected]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if expected == "features":
        assert trainable and all(".dofla." in n for n in trainable)
    elif expected == "attention":
        assert trainable and all(".attn." in n and ".dofla." not in n for n in trainable)
        assert not any("mlp" in n for n in trainable)  # GPT-2's mlp.c_proj is not an attention projection
    else:
        assert trainable and all("lora_" in n for n in trainable)


def test_unknown_or_empty_choices_are_refused():
    _, student = pair()
    with pytest.raises(DoflaError, match="choose from features, attention, lora"):
        prepare_trainable(student, ["mlp"])
    with pytest.raises(DoflaError, match="names nothing"):
        prepare_trainable(student, [])


@pytest.mark.parametrize("train, lr", [(["features", "attention"], 1e-2), (["features", "lora"], 3e-2)])
def test_distillation_lowers_the_kl_and_changes_only_what_it_trains(train, lr):
    teacher, student = pair()
    frozen = {n: p.detach().clone() for n, p in student.named_parameters()
              if ".dofla." not in n and not any(p is q for q in attention_projections(student))}
    before = mean_kl(student, teacher, tokens())
    schedule = dataclasses.replace(SCHEDULE, lr=lr)
    student, curve, used = train_kl(student, teacher, RandomRows(tokens(), 4, seed=0), train, schedule)
    assert used == SCHEDULE.steps * 4 * 32 and len(curve) == SCHEDULE.steps
    assert mean_kl(student, teacher, tokens()) < 0.85 * before  # on the rows it trained on
    params = dict(student.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in frozen.items())  # embeddings, MLPs, norms untouched
    assert not any(p.requires_grad for p in student.parameters()) and not student.training
    assert type(student).__name__.startswith("Linear")  # LoRA merged back: an ordinary student


class Crash(RuntimeError):
    pass


class CrashingRows(RandomRows):
    """RandomRows that dies when asked for batch number ``at`` (a preempted job, in process)."""

    def __init__(self, *args, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.served, self.at = 0, at

    def next_batch(self):
        if self.served == self.at:
            raise Crash
        self.served += 1
        return super().next_batch()


def old_layout(saved: dict) -> dict:
    """A loop checkpoint of the KL stage in the layout ``train_kl`` wrote before it ran on the loop harness."""
    curve = [{"step": e["step"], "kl": e["loss"]} for e in saved["state"]["units"]["student"]["curve"]]
    return {"model": saved["modules"]["student"], "optimizer": saved["optimizers"]["student"],
            "data": saved["data"]["batches"], "step": saved["state"]["step"], "curve": curve,
            "tokens": saved["data"]["used"], "meta": saved["meta"]}


@pytest.mark.long  # the KL stage's resume; tests/integration/test_resume.py kills a run inside it too (long tier)
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    teacher, reference = pair()
    resumed, other = copy.deepcopy(reference), copy.deepcopy(reference)
    train = ["features", "attention"]
    reference, _, _ = train_kl(reference, teacher, RandomRows(tokens(), 4, seed=0), train, SCHEDULE)
    ckpt, meta = tmp_path / "distill_ckpt.pt", {"run": "a"}
    with pytest.raises(Crash):  # dies at step 10; the last checkpoint is step 8's
        train_kl(copy.deepcopy(resumed), teacher, CrashingRows(tokens(), 4, seed=0, at=10), train, SCHEDULE,
                 checkpoint_path=ckpt, meta=meta)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state"]["step"] == 8
    legacy = tmp_path / "legacy_ckpt.pt"  # the same checkpoint as the stage wrote it before the loop harness
    torch.save(old_layout(saved), legacy)
    for path in (ckpt, legacy):
        resumed_here, curve, used = train_kl(copy.deepcopy(resumed), teacher, RandomRows(tokens(), 4, seed=0), train,
                                             SCHEDULE, checkpoint_path=path, meta=meta)
        assert used == SCHEDULE.steps * 4 * 32 and [c["step"] for c in curve] == list(range(SCHEDULE.steps))
        for (name, a), b in zip(reference.state_dict().items(), resumed_here.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)
    # a checkpoint of other settings is ignored: the run starts from step 0
    _, curve, _ = train_kl(other, teacher, RandomRows(tokens(), 4, seed=0), train, SCHEDULE,
                           checkpoint_path=ckpt, meta={"run": "b"})
    assert curve[0]["step"] == 0


def test_running_out_of_text_ends_early_and_counts_the_tokens(byte_tokenizer, capsys):
    from dofla.data.stream import BatchStream

    teacher, student = pair()
    stream = BatchStream(lambda: iter(["some text to read " * 30] * 3), byte_tokenizer, 2, 32)
    _, curve, used = train_kl(student, teacher, stream, ["features"], dataclasses.replace(SCHEDULE, steps=100))
    assert 0 < used < 100 * 64 and used % 64 == 0 and len(curve) == used // 64
    assert "the data ran out after" in capsys.readouterr().out
