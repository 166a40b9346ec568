"""GPT-NeoX / Pythia: fused ``query_key_value`` and ``dense`` naming, partial rotary, parallel residual."""
from __future__ import annotations

from dofla.models.adapters.base import ADAPTERS
from dofla.models.adapters.generic import GenericAdapter


@ADAPTERS.register("gpt_neox")
class GPTNeoXAdapter(GenericAdapter):
    lora_targets = ["attention.query_key_value", "attention.dense"]
    model_type = "gpt_neox"

    def attention_modules(self, model):
        return [layer.attention for layer in model.gpt_neox.layers]
