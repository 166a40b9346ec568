"""Optional ``finetune`` stage: LoRA on the attention projections after attention transfer.

LoLCATs-style: once every layer's features are trained, a short low-rank fine-tune of the
attention projections (q/k/v/o) on next-token loss lets the rest of the network adapt to the
linear attention. Everything else, the feature maps included, stays frozen. The LoRA weights are
merged back, so the result is an ordinary student (same ``save_pretrained`` / ``load_student``).
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from dofla.config import FinetuneConfig
from dofla.models import get_adapter
from dofla.precision import autocast


def finetune_lora(student, tokens: torch.Tensor, cfg: FinetuneConfig, seed: int = 0,
                  precision: str = "fp32") -> list[dict]:
    """Fine-tune ``student`` in place on ``tokens`` (S, L); returns the loss curve.

    Only LoRA weights on the adapter's ``lora_targets`` train; they are merged on return.
    """
    from peft import LoraConfig, get_peft_model

    targets = get_adapter(student).lora_targets
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=targets,
                      fan_in_fan_out=student.config.model_type == "gpt2", bias="none")
    was_training = student.training
    for p in student.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(student, lora)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    generator = torch.Generator().manual_seed(seed)
    device = next(student.parameters()).device
    curve = []
    peft_model.train()
    for step in tqdm(range(cfg.steps), desc="finetune (LoRA)", unit="step"):
        batch = tokens[torch.randint(0, tokens.shape[0], (cfg.batch_size,), generator=generator)].to(device)
        with autocast(precision, device):
            loss = peft_model(input_ids=batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        warmup.step()
        curve.append({"step": step, "loss": loss.item()})
    merged = peft_model.merge_and_unload()
    merged.train(was_training)
    return curve
