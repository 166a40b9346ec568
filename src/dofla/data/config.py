"""The ``data`` section of a run: the corpus, its tokens and the held-out split (:mod:`dofla.data`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from dofla.section_keys import Keys


@dataclass
class DataConfig:
    name: str = "embedded"
    options: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 512
    # distillation tokens (cached, or streamed once with train.source=stream); "all": one pass over
    # the prepared training split (dofla-prepare), minus the cached sample and distill.tokens
    num_tokens: Any = 8192
    # tokens whose activations are cached when training streams: Algorithm 1's sample and the
    # held-out set of the layerwise trainer (None: min(num_tokens, 8192)); the cache path caches all
    cache_tokens: Optional[int] = None
    prefetch: int = 2  # batches a thread reads ahead of the step (0: none); same batches (dofla.data.prefetch)
    heldout_tokens: int = 4096  # for held-out perplexity and attention error
    # which part of the held-out text a run scores (dofla.data.split): dev, its first heldout_tokens, inside
    # its first test_start (what every run scored before the split existed); test, the tokens from
    # test_start on: test_tokens of them (None: all, in whole sequences). heldout_tokens stays in the keys
    # of streamed layers, so a test run keeps it and shares its dev twin's trained artifacts
    heldout_split: str = "dev"
    test_start: int = 65536
    test_tokens: Optional[int] = None
    # dofla-prepare's tokens for this data and tokenizer: auto (when they exist), require, off (tokenise)
    prepared: str = "auto"
    # None: the training split in its own order; a seed: its sequences in that seed's random order
    # (prepared data only): the cached sample is a random sample of the split, the stream the rest
    shuffle_seed: Optional[int] = None

    # prepared tokens are the text path's tokens, read faster; prefetching changes no batch
    # the held-out part changes no trained artifact (a test run reuses the dev run's layers and student);
    # every evaluation measurement's key holds the digest of the tokens it scored, so it differs
    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options", "seq_len", "num_tokens", "cache_tokens", "heldout_tokens",
                                        "shuffle_seed"), out=("prepared", "prefetch", "heldout_split", "test_start",
                                                           "test_tokens"),
                                legacy={"shuffle_seed": None, "heldout_split": "dev", "test_start": 65536,
                                        "test_tokens": None})
