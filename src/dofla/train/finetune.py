"""Optional ``finetune`` stage: LoRA on the attention projections after attention transfer.

LoLCATs-style: once every layer's features are trained, a short low-rank fine-tune of the
attention projections (q/k/v/o) on next-token loss lets the rest of the network adapt to the
linear attention. Everything else, the feature maps included, stays frozen. The LoRA weights are
merged back, so the result is an ordinary student (same ``save_pretrained`` / ``load_student``).
The loop, its checkpoints (the LoRA weights, the optimiser, the row draw) and its logging are
:mod:`dofla.train.loop`'s.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dofla.train.config import FinetuneConfig
from dofla.models import get_adapter
from dofla.train.live import Log
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, run_loop


class LoraStudent(Trainer):
    """The LoRA weights of a PEFT-wrapped student on next-token loss over random rows of ``tokens``
    (S, L) (their draw is the data position); no held-out evaluation."""

    autocast, kill = True, "finetune:step"

    def __init__(self, peft_model, tokens: torch.Tensor, cfg: FinetuneConfig, seed: int):
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        self.units = {"lora": Unit(peft_model, optimizer, keep=lambda name: "lora_" in name)}
        self.model, self.tokens, self.batch_size = peft_model, tokens, cfg.batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batch_tokens, self.device = cfg.batch_size * tokens.shape[1], next(peft_model.parameters()).device

    def next_batch(self, step: int) -> torch.Tensor:
        rows = torch.randint(0, self.tokens.shape[0], (self.batch_size,), generator=self.generator)
        return self.tokens[rows].to(self.device)

    def loss(self, key, rows: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=rows, labels=rows, use_cache=False).loss

    def data_state(self):
        return self.generator.get_state()

    def restore_data(self, state) -> None:
        self.generator.set_state(state)

    def log_values(self, curves) -> dict:
        return {"loss": curves["lora"][-1]["loss"]}

    def message(self, key, step: int) -> str:
        return f"LoRA fine-tune: non-finite loss at step {step}"


def finetune_lora(student, tokens: torch.Tensor, cfg: FinetuneConfig, seed: int = 0, precision: str = "fp32",
                  checkpoint_path: Path | None = None, meta: dict | None = None,
                  on_log: Log | None = None) -> list[dict]:
    """Fine-tune ``student`` in place on ``tokens`` (S, L); returns the loss curve.

    Only LoRA weights on the adapter's ``lora_targets`` train (linear warm-up over
    ``cfg.warmup_steps``, then constant); they are merged on return. ``checkpoint_path``: where the
    loop checkpoints every 50 steps under ``meta`` (the settings), so a killed fine-tune resumes.
    """
    from peft import LoraConfig, get_peft_model  # lazy: peft (the lora extra), only for LoRA

    targets = get_adapter(student).lora_targets
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=targets,
                      fan_in_fan_out=student.config.model_type == "gpt2", bias="none")
    was_training = student.training
    for p in student.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(student, lora)
    trainer = LoraStudent(peft_model, tokens, cfg, seed)
    peft_model.train()
    loop = LoopConfig(steps=cfg.steps, warmup_steps=cfg.warmup_steps, precision=precision)
    done = run_loop(trainer, loop, Checkpointing(checkpoint_path, meta), on_log, desc="finetune (LoRA)")
    merged = peft_model.merge_and_unload()
    merged.train(was_training)
    return done.records["lora"]["curve"]
