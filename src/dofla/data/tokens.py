"""Tokenise documents and pack them into fixed-length sequences."""
from __future__ import annotations

from typing import Iterable

import torch
from tqdm.auto import tqdm

from dofla.data.sources import DataError


def pack_tokens(texts: Iterable[str], tokenizer, seq_len: int, num_tokens: int, desc: str = "tokenize",
                source: str = "data", setting: str = "data.num_tokens") -> torch.LongTensor:
    """(ceil(num_tokens / seq_len), seq_len) token ids: documents joined by EOS, cut into rows.

    ``source`` and ``setting`` only name the data and the config key in the too-few-tokens error.
    """
    if seq_len < 1 or num_tokens < 1:
        raise DataError(f"seq_len and num_tokens must be ≥ 1, got seq_len={seq_len} and num_tokens={num_tokens}")
    num_seqs = -(-num_tokens // seq_len)
    needed = num_seqs * seq_len
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    with tqdm(total=needed, desc=desc, unit="tok", leave=False) as bar:
        for number, text in enumerate(texts, start=1):
            if not isinstance(text, str):
                raise DataError(f"data source {source!r} gave document {number} as "
                                f"{type(text).__name__}, not text; check its text field")
            if not text:
                continue
            # verbose=False: a long document is expected here, not a model-length overflow
            new = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            if eos is not None:
                new.append(eos)
            bar.update(min(len(new), needed - len(ids)))
            ids.extend(new)
            if len(ids) >= needed:
                break
    if len(ids) < needed:
        raise DataError(
            f"data source {source!r} ({desc}) yields only {len(ids)} tokens but {setting}={num_tokens} "
            f"were requested ({num_seqs} sequences of {seq_len}); lower it or add data")
    return torch.tensor(ids[:needed], dtype=torch.long).view(num_seqs, seq_len)
