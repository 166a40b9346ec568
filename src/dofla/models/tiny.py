"""Tiny random models and a byte-level tokenizer, built locally (no downloads) for tests.

``TINY_ARCHITECTURES`` (three families) parametrizes most of the test suite; ``TINY_FAMILIES`` (ten,
with real transformers classes: sliding windows, q/k norms, soft-capping, non-default scaling) is
what tests/component/test_families.py covers. Every family: hidden 64, 4 heads, head size 16.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS = "<|endoftext|>"
TINY_VOCAB = 257  # 256 bytes + EOS
EOS_ID = 256
TINY_ARCHITECTURES = ("gpt2", "gpt_neox", "llama")
TINY_WINDOW = 16  # sliding window of the tiny sliding-window families, shorter than test sequences


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


def _alternating(num_layers: int) -> list[str]:
    """Sliding on even layers, global on odd ones (Gemma 2's pattern), so both kinds exist."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _gqa(num_layers: int) -> dict:
    """The Llama-style fields every GQA family shares: 4 query heads, 2 KV heads, head size 16."""
    return dict(hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True)


def _gpt2(n):
    return GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=n, n_head=4, n_positions=512)


def _gpt_neox(n):
    return GPTNeoXForCausalLM, GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=n, num_attention_heads=4, intermediate_size=128, rotary_pct=0.5,
        use_parallel_residual=True, max_position_embeddings=512)


def _llama(n):
    return LlamaForCausalLM, LlamaConfig(
        hidden_size=64, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True)


def _gemma2(n):  # soft-capped logits, scaling 1/sqrt(32) instead of 1/sqrt(16), alternating windows
    return Gemma2ForCausalLM, Gemma2Config(
        **_gqa(n), layer_types=_alternating(n), sliding_window=TINY_WINDOW, query_pre_attn_scalar=32,
        attn_logit_softcapping=5.0, pad_token_id=0)


def _gemma3(n):  # q/k norms, scaling 1/sqrt(24), alternating windows
    return Gemma3ForCausalLM, Gemma3TextConfig(
        **_gqa(n), layer_types=_alternating(n), sliding_window=TINY_WINDOW, query_pre_attn_scalar=24,
        pad_token_id=0)


TINY_FAMILIES = {
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "llama": _llama,
    "mistral": lambda n: (MistralForCausalLM, MistralConfig(**_gqa(n), sliding_window=TINY_WINDOW)),
    "qwen2": lambda n: (Qwen2ForCausalLM, Qwen2Config(  # layer 0 global, the others sliding
        **_gqa(n), use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1)),
    "qwen3": lambda n: (Qwen3ForCausalLM, Qwen3Config(**_gqa(n))),  # q/k norms
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": lambda n: (Phi3ForCausalLM, Phi3Config(**_gqa(n), pad_token_id=0)),  # fused qkv_proj
    "olmo2": lambda n: (Olmo2ForCausalLM, Olmo2Config(**_gqa(n), pad_token_id=0)),  # q/k norms, post-norm
}


def build_tiny_model(arch: str, seed: int = 0, num_layers: int = 2) -> PreTrainedModel:
    """A small random causal LM of one of ``TINY_FAMILIES`` (fp32, eval mode)."""
    if arch not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny architecture {arch!r}; valid: {', '.join(TINY_FAMILIES)}")
    cls, config = TINY_FAMILIES[arch](num_layers)
    config.vocab_size, config.bos_token_id, config.eos_token_id = TINY_VOCAB, EOS_ID, EOS_ID
    torch.manual_seed(seed)
    # SDPA cannot soft-cap logits; transformers' eager path does (what Gemma 2 checkpoints use too)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    return cls(config).eval()
