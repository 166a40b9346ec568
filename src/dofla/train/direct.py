"""``direct``: train every layer's features end to end on next-token loss (docs/method.md §3).

Only feature-map parameters train; the teacher's weights stay frozen. Uses the layerwise
trainer's config (steps, batch size, learning rates, warm-up, seed) and is checkpointed like it,
so a killed run resumes exactly.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofla import distributed
from dofla.faults import kill_point
from dofla.artifacts import load_checkpoint, torch_save_atomic
from dofla.train.layerwise import LayerTrainConfig, apply_step, lr_factor, param_groups


def feature_param_groups(student, cfg: LayerTrainConfig) -> list[dict]:
    """Freeze everything, then return the Adam groups of every layer's feature map."""
    for p in student.parameters():
        p.requires_grad_(False)
    groups = []
    for attn in student.student_attentions():
        if attn.feature_map is None:  # an exact (sliding-window) layer: nothing to train
            continue
        for p in attn.feature_map.parameters():
            p.requires_grad_(True)
        groups += param_groups(attn.feature_map, cfg)
    return groups


def train_direct(student, tokens: torch.Tensor, cfg: LayerTrainConfig,
                 checkpoint_path: Path | None = None, meta: dict | None = None) -> list[dict]:
    """Next-token training of the student's feature maps on ``tokens`` (S, L); returns the curve.

    The checkpoint records ``meta`` (the settings); one written with other settings is ignored.
    """
    groups = feature_param_groups(student, cfg)
    if not groups or cfg.steps == 0:
        return []
    optimizer = torch.optim.Adam(groups, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    step, curve = 0, []
    ckpt = load_checkpoint(checkpoint_path, meta)
    if ckpt is not None:
        student.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        generator.set_state(ckpt["generator"])
        step, curve = ckpt["step"], ckpt["curve"]
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    # eval mode: the frozen network's dropout would only add noise to the target the features chase
    student.eval()
    bar = tqdm(range(step, cfg.steps), desc="train (direct)", unit="step", disable=not distributed.is_main())
    for step in bar:
        kill_point(f"train:direct:step{step}")
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * lr_factor(step, cfg)
        batch = tokens[torch.randint(tokens.shape[0], (cfg.batch_size,), generator=generator)]
        batch = batch[distributed.rank()::distributed.world()]  # torchrun: this rank's part of the batch
        loss = student(input_ids=batch, labels=batch, use_cache=False).loss
        if apply_step(optimizer, loss, f"direct training: non-finite loss at step {step}", cfg.skip_nonfinite,
                      data_parallel=True):
            value = distributed.sum_across([loss.item()])[0] / distributed.world()  # the whole batch's loss
            curve.append({"step": step, "loss": value})
            bar.set_postfix(loss=f"{value:.4f}")
        else:
            curve.append({"step": step, "loss": None, "skipped": True})
        if checkpoint_path is not None and (step + 1) % cfg.checkpoint_every == 0 and distributed.is_main():
            features = {n: t for n, t in student.state_dict().items() if ".dofla." in n}
            torch_save_atomic({"model": features, "optimizer": optimizer.state_dict(),
                               "generator": generator.get_state(), "step": step + 1, "curve": curve,
                               "meta": meta}, checkpoint_path)
    bar.close()
    return curve
