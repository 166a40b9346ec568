"""GPT-2: fused ``c_attn`` Conv1D projection (peft needs ``fan_in_fan_out``), learned positions."""
from __future__ import annotations

from dofla.models.adapters.base import ADAPTERS
from dofla.models.adapters.generic import GenericAdapter


@ADAPTERS.register("gpt2")
class GPT2Adapter(GenericAdapter):
    lora_targets = ["attn.c_attn", "attn.c_proj"]
    model_type = "gpt2"

    def attention_modules(self, model):
        return [block.attn for block in model.transformer.h]
