"""Multi-query associative recall (MQAR, Zoology-style): can the model look a key back up?

A sequence holds ``num_pairs`` key-value token pairs, filler, then ``num_queries`` queries
``key value`` of keys seen earlier; the model must predict each query's value at its key
position. Softmax attention can recall exactly; a fixed-size linear-attention state degrades as
pairs grow, which is what this probe measures (teacher vs student, vs sequence length).

Keys, values and filler come from three disjoint id ranges, skipping the lowest ids (where
tokenizers keep special tokens) and the last id (GPT-2's end-of-text). The argmax is taken over
the value range only, so chance is exactly ``1 / num_values`` for any model.
"""
from __future__ import annotations

import torch

RESERVED_LOW = 32  # ids below this are often special tokens (SmolLM2: 0..16)


def id_ranges(vocab_size: int) -> tuple[range, range, range]:
    """(keys, values, filler): three equal, disjoint slices of the usable vocabulary."""
    low = RESERVED_LOW if vocab_size > 4 * RESERVED_LOW else 1
    third = (vocab_size - 1 - low) // 3
    if third < 2:
        raise ValueError(f"vocab_size {vocab_size} is too small for an MQAR probe")
    return (range(low, low + third), range(low + third, low + 2 * third),
            range(low + 2 * third, low + 3 * third))


def make_mqar_batch(vocab_size: int, seq_len: int, num_pairs: int, num_queries: int,
                    num_examples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (N, T), query positions (N, Q), target values (N, Q)); deterministic in ``seed``.

    Layout per row: k1 v1 … kP vP, filler, q1 a1 … qQ aQ, with T = ``seq_len``.
    """
    keys, values, filler = id_ranges(vocab_size)
    if num_pairs > len(keys) or num_queries > num_pairs:
        raise ValueError(f"need num_queries ≤ num_pairs ≤ {len(keys)} (distinct keys in this vocab)")
    gap = seq_len - 2 * (num_pairs + num_queries)
    if gap < 0:
        raise ValueError(f"seq_len {seq_len} < 2·(num_pairs + num_queries)")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(num_examples, seq_len, dtype=torch.long)
    positions = torch.empty(num_examples, num_queries, dtype=torch.long)
    targets = torch.empty(num_examples, num_queries, dtype=torch.long)
    for row in range(num_examples):
        k = keys.start + torch.randperm(len(keys), generator=gen)[:num_pairs]
        v = values.start + torch.randint(len(values), (num_pairs,), generator=gen)
        asked = torch.randperm(num_pairs, generator=gen)[:num_queries]
        noise = filler.start + torch.randint(len(filler), (gap,), generator=gen)
        queries = torch.stack([k[asked], v[asked]], 1).flatten()  # q1 a1 q2 a2 …
        ids[row] = torch.cat([torch.stack([k, v], 1).flatten(), noise, queries])
        positions[row] = 2 * num_pairs + gap + 2 * torch.arange(num_queries)
        targets[row] = v[asked]
    return ids, positions, targets


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits from an HF model or any callable returning logits (e.g. a test oracle)."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return model(input_ids=input_ids, use_cache=False).logits
    out = model(input_ids=input_ids)
    return getattr(out, "logits", out)


@torch.no_grad()
def mqar_hits(model, vocab_size: int, seq_len: int, num_pairs: int, num_queries: int,
              num_examples: int = 16, seed: int = 0, batch_size: int = 4) -> torch.Tensor:
    """(num_examples,) float64: the share of each example's queries whose value is the argmax over the
    value ids at the query key (every example asks the same number of queries)."""
    ids, positions, targets = make_mqar_batch(vocab_size, seq_len, num_pairs, num_queries,
                                              num_examples, seed)
    values = id_ranges(vocab_size)[1]
    device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else "cpu"
    hits = []
    for start in range(0, num_examples, batch_size):
        batch = ids[start : start + batch_size].to(device)
        logits = logits_of(model, batch).float()  # (B, T, V)
        pos = positions[start : start + batch_size].to(device)
        at_queries = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))  # (B, Q, V)
        guess = values.start + at_queries[..., values.start : values.stop].argmax(-1)
        hits.append((guess.cpu() == targets[start : start + batch_size]).double().mean(1))
    return torch.cat(hits)


def mqar_accuracy(model, vocab_size: int, seq_len: int, num_pairs: int, num_queries: int,
                  num_examples: int = 16, seed: int = 0, batch_size: int = 4) -> float:
    """Fraction of all queries recalled (:func:`mqar_hits` averaged over the examples)."""
    return mqar_hits(model, vocab_size, seq_len, num_pairs, num_queries, num_examples, seed,
                     batch_size).mean().item()


def max_context(model, default: int = 512) -> int:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        if config is not None and getattr(config, name, None):
            return int(getattr(config, name))
    return default


def mqar_curve(model, vocab_size: int, seq_lens: tuple[int, ...] = (128, 256, 512),
               num_examples: int = 16, seed: int = 0, batch_size: int = 4) -> dict[int, torch.Tensor]:
    """{seq_len: each example's share of queries recalled (:func:`mqar_hits`)}; each length holds
    seq_len/4 pairs and as many queries (no filler), capped by the distinct keys the vocabulary offers;
    lengths past the model's context are dropped."""
    num_keys = len(id_ranges(vocab_size)[0])
    curve = {}
    for seq_len in (t for t in seq_lens if t <= max_context(model)):
        pairs = min(seq_len // 4, num_keys)
        curve[seq_len] = mqar_hits(model, vocab_size, seq_len, pairs, pairs, num_examples, seed, batch_size)
    return curve
