"""The optional LoRA fine-tune after attention transfer: only attention projections change."""
from __future__ import annotations

import torch

from dofla.models import convert, load_student
from dofla.config import FinetuneConfig
from dofla.train.finetune import finetune_lora


def test_lora_changes_only_attention_projections_and_round_trips(tiny_model, tmp_path):
    student = convert(tiny_model, feature_map="learned_prf", dims=[8, 8])
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    curve = finetune_lora(student, tokens, FinetuneConfig(name="lora", steps=30, lr=3e-3, batch_size=4))
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed and set(before) == {n for n, _ in student.named_parameters()}
    assert all(("attn" in n or "attention" in n) and "dofla" not in n for n in changed)
    first, last = sum(c["loss"] for c in curve[:5]) / 5, sum(c["loss"] for c in curve[-5:]) / 5
    assert last < first
    student.save_pretrained(tmp_path)
    reloaded = load_student(tmp_path)
    with torch.no_grad():
        assert torch.equal(student(tokens, use_cache=False).logits, reloaded(tokens, use_cache=False).logits)
