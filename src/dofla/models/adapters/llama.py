"""Llama family (Llama, SmolLM2, Mistral-style): RoPE and grouped-query attention."""
from __future__ import annotations

from dofla.models.adapters.base import ADAPTERS, Adapter, AttentionGeometry


@ADAPTERS.register("mistral")
@ADAPTERS.register("llama")
class LlamaAdapter(Adapter):
    # attention projections a LoRA fine-tune adapts (module-name suffixes, as peft matches them)
    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model_type = "llama"

    def geometry(self, config) -> AttentionGeometry:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return AttentionGeometry(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            max_positions=config.max_position_embeddings,
        )

    def attention_modules(self, model):
        return [layer.self_attn for layer in model.model.layers]
