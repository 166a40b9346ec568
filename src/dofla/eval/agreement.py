"""Generation-scored agreement: how often the student's greedy continuation of a held-out prompt agrees
with the teacher's. A log-likelihood score can hide a gap that shows once the model must generate: one
wrong token and the rest of the continuation runs on the model's own text.

Per prompt: whether the first generated token agrees, and the matched prefix length (the number of
leading generated tokens that agree, 0..n). The prompts are the held-out sequences cut into pieces of
``prompt_len`` tokens, the first ``count`` of them.
"""
from __future__ import annotations

import torch

from dofla.errors import require


def agreement_prompts(heldout: torch.Tensor, count: int, prompt_len: int) -> torch.Tensor:
    """(count, prompt_len) prompts: each held-out sequence (S, L) cut into ``L // prompt_len`` pieces,
    in reading order, the first ``count`` of them."""
    pieces = heldout[:, : heldout.shape[1] // prompt_len * prompt_len].reshape(-1, prompt_len)
    require(pieces.shape[0] >= count,
            f"eval.agreement_prompts={count} needs {count} prompts of eval.agreement_prompt_len={prompt_len} tokens, "
            f"but the held-out text gives {pieces.shape[0]}; ask for fewer prompts or raise data.heldout_tokens")
    return pieces[:count]


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int) -> torch.Tensor:
    """(N, new_tokens) greedy continuations of equal-length ``prompts`` (N, P), by ``generate()`` with the
    model's decode cache, ``batch_size`` prompts at a time. No end-of-text stop: every continuation has
    ``new_tokens`` tokens (so every prompt counts the same)."""
    device = next(model.parameters()).device
    out = []
    for part in prompts.split(batch_size):
        ids = part.to(device)
        done = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, use_cache=True, eos_token_id=None,
                              pad_token_id=0)
        out.append(done[:, ids.shape[1]:].cpu())
    return torch.cat(out)


@torch.no_grad()
def greedy_reference(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The plain form of :func:`greedy_continuations`: one full forward over the whole text per new
    token, no cache."""
    device = next(model.parameters()).device
    ids = prompts.to(device)
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1]:].cpu()


def matched_prefix(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per row of two (N, n) continuations, how many leading tokens agree (0..n)."""
    return (student == teacher).long().cumprod(dim=1).sum(dim=1)


def agreement_metrics(teacher, student, prompts: torch.Tensor, new_tokens: int, batch_size: int) -> dict:
    """``agreement/first_token`` (share of prompts whose first generated token agrees) and
    ``agreement/prefix_len`` (mean matched prefix length, out of ``new_tokens``), and each prompt's
    under ``seq/``."""
    wanted = greedy_continuations(teacher, prompts, new_tokens, batch_size)
    got = greedy_continuations(student, prompts, new_tokens, batch_size)
    matched = matched_prefix(got, wanted)
    first = (matched > 0).float()
    return {"agreement/first_token": first.mean().item(), "agreement/prefix_len": matched.float().mean().item(),
            "agreement/new_tokens": new_tokens,
            "seq/agreement/first_token": first.tolist(), "seq/agreement/prefix_len": matched.float().tolist()}
