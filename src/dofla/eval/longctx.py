"""Long-context measurements: where a window cannot see, and whether the linear part earns its keep.

- :func:`mass_outside_window`: per layer, the share of the teacher's attention probability on keys
  that a sliding window of W (plus S sink tokens) cannot see. It bounds what a linear part of a
  hybrid student can contribute: where the teacher puts no mass beyond the window, a window alone
  is exact.
- :func:`loss_by_position`: held-out next-token loss per position bucket, so a deficit that grows
  with distance (a window's) is visible.
- :func:`passkey_probe`: a needle probe: a 5-digit number hidden in filler text at a random
  depth must be repeated at the end (greedy decoding), at several context lengths; with the nats
  the model spends on the answer, which moves before the accuracy does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dofla.eval.metrics import next_token_nll
from dofla.models import capture_qkv


def outside_window_mask(length: int, window: int, sinks: int = 0, device=None) -> torch.Tensor:
    """(L, L) bool: True where key j is visible to query i (j ≤ i) but neither in the last
    ``window`` positions (j > i − window) nor a sink (j < sinks)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return (j <= i - window) & (j >= sinks)


@torch.no_grad()
def mass_outside_window(teacher, tokens: torch.Tensor, window: int, sinks: int = 0,
                        batch_size: int = 1) -> list[float]:
    """Per layer, the teacher's mean attention probability outside window + sinks.

    tokens (S, L). Averaged over heads, sequences and every query position (queries closer to
    the start than the window contribute 0: they see everything the window does).
    """
    sums: list[float] = []
    rows = 0
    device = next(teacher.parameters()).device
    for batch in tokens.split(batch_size):
        layers = capture_qkv(teacher, batch.to(device))
        for index, (q, k, _) in enumerate(layers):
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, L, L)
            length = scores.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            outside = (p * outside_window_mask(length, window, sinks, device)).sum(-1)  # (B, H, L)
            value = outside.mean(1).sum().item()  # heads averaged, rows summed
            if index == len(sums):
                sums.append(0.0)
            sums[index] += value
        rows += batch.shape[0] * batch.shape[1]
    return [s / rows for s in sums]


@torch.no_grad()
def losses_by_position(model, tokens: torch.Tensor, edges: list[int], batch_size: int = 1) -> torch.Tensor:
    """(S, len(edges) − 1) float64: each sequence's mean next-token NLL per position bucket
    [edges[b], edges[b+1]) of the predicted token.

    tokens (S, L); position p is the prediction of token p from tokens < p (p ≥ 1). Buckets past
    L are NaN.
    """
    if sorted(edges) != list(edges) or len(edges) < 2:
        raise ValueError(f"edges must be increasing with at least two entries, got {edges}")
    device = next(model.parameters()).device
    positions = torch.arange(1, tokens.shape[1])
    bucket = torch.bucketize(positions, torch.tensor(edges), right=True) - 1  # (L-1,)
    out = torch.full((tokens.shape[0], len(edges) - 1), float("nan"), dtype=torch.float64)
    for start in tqdm(range(0, tokens.shape[0], batch_size), desc="loss by position", unit="seq", leave=False):
        batch = tokens[start : start + batch_size].to(device)
        nll = next_token_nll(model(input_ids=batch, use_cache=False).logits, batch)  # (B, L-1)
        for b in range(len(edges) - 1):
            pick = bucket == b
            if pick.any():
                out[start : start + batch.shape[0], b] = nll[:, pick].double().mean(-1).cpu()
    return out


def loss_by_position(model, tokens: torch.Tensor, edges: list[int], batch_size: int = 1) -> list[float]:
    """Mean next-token NLL per position bucket (see :func:`losses_by_position`; NaN past L)."""
    return losses_by_position(model, tokens, edges, batch_size).mean(0).tolist()


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(tokenizer, length: int, passkey: int, depth: float) -> torch.Tensor:
    """Token ids of about ``length`` tokens: filler, the passkey sentence at relative ``depth``,
    more filler, then the question; the answer is the passkey's digits."""
    head = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = "What is the pass key? The pass key is"
    fixed = len(tokenizer(head + needle + question).input_ids)
    per_filler = len(tokenizer(FILLER).input_ids)
    repeats = max(0, (length - fixed) // per_filler)
    before = round(repeats * depth)
    text = head + FILLER * before + needle + FILLER * (repeats - before) + question
    return torch.tensor([tokenizer(text).input_ids])


def passkey_probe(model, tokenizer, lengths: list[int], trials: int = 4, seed: int = 0) -> dict[int, tuple[float, float]]:
    """Per context length, (accuracy, answer NLL): the share of trials whose greedy continuation
    starts with the passkey, and the mean over trials of the nats the model spends on the answer
    text " <passkey>" given the prompt (teacher-forced; a uniform guess of 5 digits costs 11.5).

    The NLL moves long before the accuracy does, so it shows whether a student is getting closer to
    recalling the key. Depths are spread evenly over (0, 1); passkeys are seeded 5-digit numbers.
    """
    return {length: (sum(hit for hit, _ in results) / trials, sum(nll for _, nll in results) / trials)
            for length, results in passkey_results(model, tokenizer, lengths, trials, seed).items()}


def passkey_results(model, tokenizer, lengths: list[int], trials: int = 4, seed: int = 0) -> dict[int, list]:
    """Per context length, each trial's (recalled, answer NLL) (:func:`passkey_trials`); the prompts of
    every length are drawn in order from one generator seeded with ``seed``, the same for every model."""
    gen = torch.Generator().manual_seed(seed)
    return {length: passkey_trials(model, tokenizer, length, trials, gen) for length in lengths}


@torch.no_grad()
def passkey_trials(model, tokenizer, length: int, trials: int, gen: torch.Generator) -> list[tuple[bool, float]]:
    """(recalled, answer NLL) of each of ``trials`` passkey prompts of ``length`` tokens, the
    passkeys drawn from ``gen``: the same prompts for every model given the same generator state.

    Both come from one teacher-forced forward over prompt + answer: greedy decoding starts with the
    answer exactly when every answer token is the argmax after the ones before it. Only when the first
    differing token could still spell the passkey (another tokenisation of the digits) does the trial
    decode greedily, as :func:`recalled_by_decoding` does for every trial.
    """
    device = next(model.parameters()).device
    results = []
    for t in tqdm(range(trials), desc=f"passkey @ {length}", unit="prompt", leave=False):
        passkey, ids, key = passkey_case(tokenizer, length, gen, depth=(t + 0.5) / trials)
        ids, key = ids.to(device), key.to(device)
        logits = model(torch.cat([ids, key], dim=1)).logits[0, ids.shape[1] - 1:-1].float()  # (A, V)
        nll = F.cross_entropy(logits, key[0], reduction="sum").item()
        recalled = recalled_from_argmax(tokenizer, passkey, key[0].tolist(), logits.argmax(-1).tolist())
        if recalled is None:
            recalled = recalled_by_decoding(model, tokenizer, ids, passkey)
        results.append((recalled, nll))
    return results


def recalled_from_argmax(tokenizer, passkey: int, answer: list[int], argmax: list[int]) -> bool | None:
    """Whether greedy decoding after the prompt starts with ``passkey``, from the teacher-forced argmax
    at each answer position; None when the first differing token leaves it open."""
    mismatch = next((i for i, (a, g) in enumerate(zip(answer, argmax)) if a != g), None)
    if mismatch is None:
        return True
    text, key = tokenizer.decode(answer[:mismatch] + [argmax[mismatch]], skip_special_tokens=True).strip(), str(passkey)
    if text.startswith(key):
        return True
    return None if key.startswith(text) else False


@torch.no_grad()
def recalled_by_decoding(model, tokenizer, prompt: torch.Tensor, passkey: int) -> bool:
    """Whether the greedy continuation (8 tokens) of ``prompt`` (1, P) starts with ``passkey``."""
    out = model.generate(prompt, max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip().startswith(str(passkey))


def passkey_case(tokenizer, length: int, gen: torch.Generator, depth: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One passkey prompt: (passkey, prompt ids (1, P), answer " <passkey>" ids (1, A)), the
    5-digit passkey drawn from ``gen``, its needle at relative ``depth``."""
    passkey = int(torch.randint(10000, 100000, (1,), generator=gen))
    answer = tokenizer(f" {passkey}", add_special_tokens=False, return_tensors="pt").input_ids
    return passkey, passkey_prompt(tokenizer, length, passkey, depth), answer


def answer_nll(model, prompt: torch.Tensor, answer: torch.Tensor) -> float:
    """Nats ``model`` spends on ``answer`` (1, A) right after ``prompt`` (1, P), teacher-forced. Only the last
    A + 1 positions' logits are computed (``logits_to_keep``): the head over the prompt's positions would be
    thrown away, and on a large vocabulary it is much of a long prompt's forward."""
    return answer_nats(model, prompt, answer).item()


def answer_nats(model, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """:func:`answer_nll` as a tensor, its graph kept when gradients are on."""
    logits = model(torch.cat([prompt, answer], dim=1), logits_to_keep=answer.shape[1] + 1).logits[0, :-1]
    return F.cross_entropy(logits.float(), answer[0], reduction="sum")
