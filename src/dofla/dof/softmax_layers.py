"""Which layers to keep as exact softmax: ranked by what restoring each one does to the model's KL.

A layer's attention error does not say how much the model's predictions depend on it (errors
compound or wash out through the layers after it), so the ranking is measured on the model: for
each linear, hybrid or sliding-window layer i (:func:`dofla.models.restorable_layers`), the student
with layer i alone restored to exact softmax runs on probe sequences of the training text, and its
KL(teacher ‖ student) on the next-token distributions is compared with the student's own. The k
layers whose restoration lowers the KL most are kept exact (:func:`dofla.models.restore_softmax`).
``rank="attention_error"`` ranks by each layer's own attention-output error instead (cheaper: one
teacher pass; the control the measured ranking is compared against). Restoring one layer at a time
ranks the layers independently; the gains of several restored together need not add up, so
``rank="kl_greedy"`` chooses one layer at a time with the layers already chosen kept exact
(:func:`greedy_restoration_kl`): each step measures every remaining layer on top of the choice so far.
``rank="retrieval"`` ranks by what next-token KL on ordinary text does not see: the teacher's
long-range copying (:func:`retrieval_scores`, one teacher pass), for students that must recall a
fact from far back (a passkey). ``rank="passkey"`` measures that recall on the student itself: the
greedy choice again, by the nats the student spends on the answers of passkey prompts
(:func:`greedy_restoration_passkey`; other keys and depths than the eval's probe).

Cost: per probe batch one teacher forward and L + 1 student forwards (the teacher's logits live
one batch at a time, never stored); the greedy choice of k layers one teacher forward and about L
student forwards per step. Kept layers cost a KV cache when decoding: :func:`kv_bytes_per_token`
per token of context.
"""
from __future__ import annotations

from contextlib import ExitStack

import torch
from tqdm.auto import tqdm

from dofla.eval.longctx import answer_nll, passkey_case
from dofla.eval.metrics import attention_errors
from dofla.models import restorable_layers, softmax_restored
from dofla.models.adapters.support import get_adapter
from dofla.models.capture import capture_qkv
from dofla.train.distill import kl_to_teacher


@torch.no_grad()
def restoration_kl(student, teacher, tokens: torch.Tensor, batch_size: int = 2,
                   layers: list[int] | None = None) -> dict:
    """KL(teacher ‖ student) per predicted token over ``tokens`` (S, L), as the student is and with
    each layer of ``layers`` (default: every one :func:`dofla.models.restorable_layers` names)
    restored to softmax alone.

    Returns {"base": float, "restored": {layer: float}}; both are means over all S·L tokens.
    """
    device = next(student.parameters()).device
    if layers is None:
        layers = restorable_layers(student)
    sums = dict.fromkeys([None, *layers], 0.0)
    count = 0
    batches = tokens.split(batch_size)
    with tqdm(total=len(batches) * len(sums), desc="softmax layers: KL per restored layer", unit="forward",
              leave=False) as progress:
        for batch in batches:
            batch = batch.to(device)
            target = teacher(input_ids=batch, use_cache=False).logits
            for layer in sums:
                with softmax_restored(student, layer):
                    logits = student(input_ids=batch, use_cache=False).logits
                sums[layer] += kl_to_teacher(logits, target).item() * batch.numel()
                progress.update()
            count += batch.numel()
    return {"base": sums[None] / count, "restored": {i: sums[i] / count for i in layers}}


@torch.no_grad()
def greedy_restoration_kl(student, teacher, tokens: torch.Tensor, k: int, batch_size: int = 2,
                          steps: list[dict] | None = None) -> list[dict]:
    """The greedy choice of ``k`` layers to restore: step s keeps the layers of steps < s exact and
    adds the one (of those with features) whose restoration then gives the lowest KL(teacher ‖ student)
    per predicted token over ``tokens`` (S, L); ties by index. ``steps`` (from an earlier call on
    the same student and probe) are kept and extended, not measured again.

    Returns [{"layer": i, "kl": KL with it and every earlier step's layer restored}, …], k long.
    """
    def measure(left):
        return restoration_kl(student, teacher, tokens, batch_size, left)["restored"]

    return _greedy(student, k, steps, measure, "kl")


@torch.no_grad()
def greedy_restoration_passkey(student, prompts: list[tuple[torch.Tensor, torch.Tensor]], k: int,
                               steps: list[dict] | None = None) -> list[dict]:
    """The greedy choice of ``k`` layers to restore by passkey recall: step s keeps the layers of
    steps < s exact and adds the one whose restoration then gives the lowest mean answer NLL over
    ``prompts`` (:func:`passkey_prompts`); ties by index; ``steps`` are kept and extended.

    Returns [{"layer": i, "nll": mean answer nats with it and every earlier step's layer restored}, …].
    """
    def measure(left):
        return restoration_passkey(student, prompts, left)["restored"]

    return _greedy(student, k, steps, measure, "nll")


def _greedy(student, k: int, steps: list[dict] | None, measure, name: str) -> list[dict]:
    """Greedy steps up to ``k``: ``measure(left)`` gives {layer: value} with the chosen layers kept
    exact; each step takes the lowest."""
    candidates = restorable_layers(student)
    if k > len(candidates):
        raise ValueError(f"{k} softmax layers were asked for but only {len(candidates)} layers can be restored "
                         "(linear, hybrid or sliding-window)")
    steps = list(steps or [])[:k]
    while len(steps) < k:
        chosen = [s["layer"] for s in steps]
        left = [i for i in candidates if i not in chosen]
        with ExitStack() as kept:
            for layer in chosen:
                kept.enter_context(softmax_restored(student, layer))
            values = measure(left)
        best = min(left, key=lambda i: (values[i], i))
        steps.append({"layer": best, name: values[best]})
    return steps


PASSKEY_SALT = 1_000_003  # selection prompts draw their keys from seed + this: never the eval's keys


def passkey_prompts(tokenizer, length: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` passkey prompts of about ``length`` tokens to choose layers on, as (prompt (1, P),
    answer " <key>" (1, A)) token ids: the eval probe's format (:func:`dofla.eval.longctx.passkey_prompt`),
    with keys drawn from ``seed + PASSKEY_SALT`` and needles at depths (t + 0.25) / count, so the
    eval's prompts (keys from ``seed``, depths (t + 0.5) / trials) are not the ones chosen on."""
    gen = torch.Generator().manual_seed(seed + PASSKEY_SALT)
    return [passkey_case(tokenizer, length, gen, depth=(t + 0.25) / count)[1:] for t in range(count)]


@torch.no_grad()
def restoration_passkey(student, prompts: list[tuple[torch.Tensor, torch.Tensor]],
                        layers: list[int] | None = None) -> dict:
    """Mean answer NLL (nats) over ``prompts`` (:func:`passkey_prompts`), as the student is and with
    each layer of ``layers`` (default: every one :func:`dofla.models.restorable_layers` names)
    restored to softmax alone.

    Returns {"base": float, "restored": {layer: float}}.
    """
    device = next(student.parameters()).device
    if layers is None:
        layers = restorable_layers(student)
    sums = dict.fromkeys([None, *layers], 0.0)
    with tqdm(total=len(prompts) * len(sums), desc="softmax layers: passkey NLL per restored layer",
              unit="forward", leave=False) as progress:
        for prompt, answer in prompts:
            prompt, answer = prompt.to(device), answer.to(device)
            for layer in sums:
                with softmax_restored(student, layer):
                    sums[layer] += answer_nll(student, prompt, answer)
                progress.update()
    return {"base": sums[None] / len(prompts), "restored": {i: sums[i] / len(prompts) for i in layers}}


RANKS = ("kl", "kl_greedy", "attention_error", "retrieval", "passkey")


def copy_probe(tokens: torch.Tensor, start: int = 8, span: int = 16) -> tuple[torch.Tensor, int]:
    """``tokens`` (S, L) with each row's tokens [start, start + span) repeated as its last tokens: a
    copy from about L tokens back. ``span`` shrinks to fit short rows; returns (probe, span)."""
    span = min(span, (tokens.shape[1] - start) // 3)
    if span < 2:
        raise ValueError(f"a copy probe needs sequences of at least {start + 6} tokens, not {tokens.shape[1]}")
    probe = tokens.clone()
    probe[:, -span:] = tokens[:, start:start + span]
    return probe, span


@torch.no_grad()
def copying_scores(teacher, tokens: torch.Tensor, batch_size: int = 2, start: int = 8,
                   layers: list[int] | None = None) -> dict[int, torch.Tensor]:
    """{layer: (H,) scores}: per query head of each of ``layers`` (default: all), its mean attention
    probability, from each token of a span repeated at the end of the text (:func:`copy_probe` of
    ``tokens``), to the token that followed the same token in the span's first occurrence: the key an
    induction head reads to copy the next token, about L positions back. 1 is a perfect copier."""
    device = next(teacher.parameters()).device
    softcap = get_adapter(teacher).geometry(teacher.config).softcap
    probe, span = copy_probe(tokens, start)
    length = probe.shape[1]
    queries = torch.arange(length - span, length - 1, device=device)  # every repeated token but the last
    targets = queries - (length - span) + start + 1  # the token after its first occurrence
    rows = torch.arange(len(queries), device=device)
    future = torch.arange(length, device=device)[None, :] > queries[:, None]  # (Q, L), the causal mask
    sums: dict[int, torch.Tensor | float] = {}
    for batch in probe.split(batch_size):
        captured = capture_qkv(teacher, batch.to(device))
        for i in range(len(captured)) if layers is None else layers:
            q, k, _ = captured[i]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
            logits = q[:, :, queries].float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, Q, L)
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)
            hits = probs[:, :, rows, targets]  # (B, H, Q)
            sums[i] = sums.get(i, 0.0) + hits.mean(-1).sum(0).cpu()  # per head, summed over sequences
    return {i: total / probe.shape[0] for i, total in sums.items()}


def retrieval_scores(teacher, tokens: torch.Tensor, layers: list[int], batch_size: int = 2, start: int = 8) -> dict:
    """{"retrieval": {layer: score}}: per layer of ``layers``, its strongest head's :func:`copying_scores`."""
    scores = copying_scores(teacher, tokens, batch_size, start, layers)
    return {"retrieval": {i: float(scores[i].max()) for i in layers}}


@torch.no_grad()
def probe_retrieval(student, teacher, tokens: torch.Tensor, batch_size: int = 2) -> dict:
    """:func:`retrieval_scores` of the student's restorable layers, on the teacher."""
    layers = restorable_layers(student)
    return retrieval_scores(teacher, tokens, layers, batch_size)


@torch.no_grad()
def probe_attention_errors(student, teacher, tokens: torch.Tensor, batch_size: int = 2) -> dict:
    """{"attention_error": {layer: error}}: each restorable layer's own attention-output error on the
    teacher's activations of ``tokens`` (the cheaper proxy ranking, ``rank="attention_error"``)."""
    errors = attention_errors(teacher, student, tokens, batch_size)
    return {"attention_error": {i: errors[i] for i in restorable_layers(student)}}


def rank_layers(measured: dict, rank: str = "kl") -> list[int]:
    """Layers, best to restore first: by ``kl``, the lowest KL with the layer restored alone (the
    largest gain); by ``attention_error``, the largest error of the layer's own attention; by
    ``retrieval``, the teacher's strongest long-range copying; by ``kl_greedy`` and ``passkey``, the
    order the greedy choice took them (only as many as it has measured). Ties by index."""
    if rank not in RANKS:
        raise ValueError(f"rank={rank!r} is not one of {', '.join(RANKS)}")
    if rank == "kl_greedy":
        return [int(step["layer"]) for step in measured["greedy"]]
    if rank == "passkey":
        return [int(step["layer"]) for step in measured["passkey"]["greedy"]]
    if rank == "kl":
        values = {int(i): kl for i, kl in measured["restored"].items()}
    else:
        values = {int(i): -value for i, value in measured[rank].items()}  # the largest first
    return sorted(values, key=lambda i: (values[i], i))


def choose(measured: dict, k: int, rank: str = "kl") -> list[int]:
    """The ``k`` best layers to restore under ``rank`` (:func:`rank_layers`), in layer order."""
    ranking = rank_layers(measured, rank)
    if rank in ("kl_greedy", "passkey") and k > len(ranking):
        raise ValueError(f"{k} softmax layers were asked for but the greedy choice has {len(ranking)} steps; "
                         f"extend it with greedy_restoration_{'kl' if rank == 'kl_greedy' else 'passkey'}")
    if k > len(ranking):
        raise ValueError(f"{k} softmax layers were asked for but only {len(ranking)} layers can be restored "
                         "(linear, hybrid or sliding-window)")
    return sorted(ranking[:k])


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int = 4) -> int:
    """Decoding memory the kept softmax layers add per token of context: a key and a value per KV head."""
    return layers * 2 * kv_heads * head_dim * bytes_per_value
