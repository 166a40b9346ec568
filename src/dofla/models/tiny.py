"""Tiny random models and a byte-level tokenizer, built locally (no downloads) for tests."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

EOS = "<|endoftext|>"
TINY_VOCAB = 257  # 256 bytes + EOS
TINY_ARCHITECTURES = ("gpt2", "gpt_neox", "llama")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte, plus an EOS token (id 256)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab[EOS] = 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (what ByteLevel uses internally)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_model(arch: str, seed: int = 0, num_layers: int = 2) -> PreTrainedModel:
    """A small random causal LM of the given architecture (fp32, eval mode)."""
    common = dict(vocab_size=TINY_VOCAB, bos_token_id=256, eos_token_id=256)
    if arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=num_layers, n_head=4, n_positions=512, **common)
        cls = GPT2LMHeadModel
    elif arch == "gpt_neox":
        config = GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
            intermediate_size=128, rotary_pct=0.5, use_parallel_residual=True,
            max_position_embeddings=512, **common,
        )
        cls = GPTNeoXForCausalLM
    elif arch == "llama":
        config = LlamaConfig(
            hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
            tie_word_embeddings=True, **common,
        )
        cls = LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; valid: {', '.join(TINY_ARCHITECTURES)}")
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return cls(config).eval()
