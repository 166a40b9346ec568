"""GPT-2: fused ``c_attn`` projection, learned absolute positions, no GQA."""
from __future__ import annotations

from dofla.models.adapters.base import ADAPTERS, Adapter, AttentionGeometry


@ADAPTERS.register("gpt2")
class GPT2Adapter(Adapter):
    # attention projections a LoRA fine-tune adapts (module-name suffixes, as peft matches them)
    lora_targets = ["attn.c_attn", "attn.c_proj"]
    model_type = "gpt2"

    def geometry(self, config) -> AttentionGeometry:
        return AttentionGeometry(
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            max_positions=config.n_positions,
        )

    def attention_modules(self, model):
        return [block.attn for block in model.transformer.h]
