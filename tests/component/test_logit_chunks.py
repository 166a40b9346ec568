"""The distill stage's KL with the LM head in chunks of positions (``distill.logit_chunk``): the same
loss and gradient as the whole logits, for every adapter family and under LoRA, less memory per
sequence, and a model whose head it cannot reproduce refused."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dofla.errors import DoflaError
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train import capacity
from dofla.train.distill import DistillSchedule, accumulate, attention_projections, prepare_trainable
from dofla.train.logit_chunks import check_head

SCHEDULE = DistillSchedule(steps=2, micro_batch_size=3, lr=1e-2, feature_lr=1e-2)


def pair(arch: str):
    teacher = build_tiny_model(arch, seed=0).eval()
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[8, 8])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # attention outputs perturbed, so the KL and its gradient are far from 0
        for p in attention_projections(student):
            if p.ndim == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return teacher.double(), student.double()


@pytest.mark.parametrize("arch, train", [("llama", ["features", "attention"]), ("gpt2", ["features", "attention"]),
                                         ("gpt_neox", ["features", "attention"]), ("llama", ["lora"])])
def test_chunked_logits_give_the_whole_kl_and_its_gradient(arch, train):
    teacher, student = pair(arch)
    model, groups = prepare_trainable(student, train, 4, 8)
    model.double()
    params = [p for _, ps in groups for p in ps]
    batch = torch.randint(0, teacher.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(0))
    check_head(model, batch)
    results = []
    for chunk in (0, 7, 20):  # whole; uneven chunks; one chunk through the body-and-head path
        model.zero_grad(set_to_none=True)
        kl = accumulate(model, teacher, batch, dataclasses.replace(SCHEDULE, logit_chunk=chunk))
        results.append((kl, torch.cat([p.grad.flatten() for p in params])))
    (kl0, g0), rest = results[0], results[1:]
    assert kl0 > 1e-3 and g0.abs().max() > 0
    for kl, g in rest:  # the KL runs in float32 whatever the model's dtype: its rounding, nothing more
        torch.testing.assert_close(kl, kl0, rtol=1e-6, atol=0)
        torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-6 * g0.abs().max().item())


def test_a_head_dofla_cannot_reproduce_is_refused_in_one_sentence():
    teacher, _ = pair("llama")
    teacher.config.final_logit_softcapping = 0.5  # Llama's head ignores it; the chunked head would cap
    with pytest.raises(DoflaError, match="cannot reproduce the LM head of model type 'llama'.*logit_chunk=0"):
        check_head(teacher, torch.randint(0, 256, (1, 16)))


def test_chunks_lower_the_traced_memory_per_sequence():
    teacher = build_tiny_model("llama", seed=0, num_layers=2)

    def student_of(model):
        return convert(copy.deepcopy(model), feature_map="hedgehog", dims=[16] * model.config.num_hidden_layers)

    def per_sample(chunk):
        s = DistillSchedule(steps=2, micro_batch_size=1, lr=1e-4, feature_lr=1e-3, logit_chunk=chunk)
        return capacity.kl_step_peak(student_of, teacher, 2, s, ["features", "attention"], (8, 16), 256, 0, 2).per_sample

    whole, chunked = per_sample(0), per_sample(32)
    logits = 256 * teacher.config.vocab_size * 4  # one sequence's logits in float32
    # whole, the student's logits, the teacher's probabilities and the logits' gradient are alive at once in the
    # KL's backward (the fused KL keeps nothing else: the peak may then be the body's backward, with neither)
    assert whole - chunked > logits / 2
