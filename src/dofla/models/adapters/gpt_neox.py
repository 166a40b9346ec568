"""GPT-NeoX / Pythia: fused query_key_value, partial rotary, parallel residual."""
from __future__ import annotations

from dofla.models.adapters.base import ADAPTERS, Adapter, AttentionGeometry


@ADAPTERS.register("gpt_neox")
class GPTNeoXAdapter(Adapter):
    # attention projections a LoRA fine-tune adapts (module-name suffixes, as peft matches them)
    lora_targets = ["attention.query_key_value", "attention.dense"]
    model_type = "gpt_neox"

    def geometry(self, config) -> AttentionGeometry:
        return AttentionGeometry(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            max_positions=config.max_position_embeddings,
        )

    def attention_modules(self, model):
        return [layer.attention for layer in model.gpt_neox.layers]
