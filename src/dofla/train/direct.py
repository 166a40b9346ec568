"""``direct``: train every layer's features end to end on next-token loss (docs/method.md §3).

Only feature-map parameters train; the teacher's weights stay frozen. Uses the layerwise
trainer's config (steps, batch size, learning rates, warm-up, seed) and is checkpointed like it,
so a killed run resumes exactly.

Batches come either from a token tensor (rows drawn at random, with replacement, for ``cfg.steps``
steps: ``RandomRows``) or from a ``BatchStream`` of fresh text (one pass, ``train.source=stream``);
both are resumable, their position is part of the checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from dofla import distributed
from dofla.faults import kill_point
from dofla.precision import autocast
from dofla.artifacts import load_checkpoint, torch_save_atomic
from dofla.train.layerwise import LayerTrainConfig, param_groups
from dofla.train.losses import next_token_loss
from dofla.train.live import Live, Log
from dofla.train.step import Accumulator, lr_factor, micro_batches


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


class RandomRows:
    """(B, L) batches of ``tokens`` (S, L) rows drawn at random with replacement (seeded), with the
    ``BatchStream`` interface: ``next_batch()``, ``state()``, ``restore(state)``."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seed: int):
        self.tokens, self.batch_size = tokens, batch_size
        self.batch_tokens = batch_size * tokens.shape[1]
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        return self.tokens[torch.randint(self.tokens.shape[0], (self.batch_size,), generator=self.generator)]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def train_direct(student, tokens, cfg: LayerTrainConfig, checkpoint_path: Path | None = None,
                 meta: dict | None = None, on_log: Log | None = None, progress: bool = True) -> list[dict]:
    """Next-token training of the student's feature maps; returns the curve.

    ``tokens``: a (S, L) tensor (``cfg.steps`` steps of ``cfg.batch_size`` random rows), or a batch
    source like ``RandomRows`` (``next_batch()``, ``state()``, ``restore()``, ``batch_tokens``) such
    as a ``BatchStream`` (then ``cfg.steps`` steps of its batches, in order). The checkpoint
    records ``meta`` (the settings) and the source's position; one written with other settings is
    ignored. ``on_log`` gets the loss, tokens/s and ETA every ``cfg.log_every`` steps; ``progress=False``
    hides the bar (the memory preflight's probe steps).
    """
    groups = feature_param_groups(student, cfg)
    if not groups or cfg.steps == 0:
        return []
    batches = RandomRows(tokens, cfg.batch_size, cfg.seed + 1) if isinstance(tokens, torch.Tensor) else tokens
    optimizer = torch.optim.Adam(groups, weight_decay=0.0)
    device = next(student.parameters()).device
    step, curve = 0, []
    base_lrs = [g["lr"] for g in optimizer.param_groups]  # before a checkpoint's scheduled rates replace them
    ckpt = load_checkpoint(checkpoint_path, meta)
    if ckpt is not None:
        student.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        batches.restore(ckpt["data"] if "data" in ckpt else ckpt["generator"])  # "generator": before streaming
        step, curve = ckpt["step"], ckpt["curve"]
    # eval mode: the frozen network's dropout would only add noise to the target the features chase
    student.eval()
    # counted in tokens, so the bar shows tokens done, tokens/s and the ETA
    bar = tqdm(total=cfg.steps * batches.batch_tokens, initial=step * batches.batch_tokens, desc="train (direct)",
               unit="tok", unit_scale=True, disable=not (progress and distributed.is_main()))
    live = Live(on_log, cfg.log_every, cfg.steps * batches.batch_tokens, step * batches.batch_tokens,
                reduce=distributed.mean_across)
    for step in range(step, cfg.steps):
        kill_point(f"train:direct:step{step}")
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * lr_factor(step, cfg)
        batch = batches.next_batch().to(device)
        batch = distributed.my_rows(batch)  # torchrun: this rank's part of the batch
        accumulated = Accumulator(optimizer)
        for part, share in micro_batches(batch, cfg):
            with autocast(cfg.precision, device):
                loss = next_token_loss(student, part)
            accumulated.add(loss, share)
        loss = accumulated.step(f"direct training: non-finite loss at step {step}", cfg.skip_nonfinite,
                                data_parallel=True)
        curve.append({"step": step, "loss": None, **({} if loss is not None else {"skipped": True})})
        if loss is not None:  # the whole batch's loss: the mean over the ranks, at the next flush
            live.hold(curve[-1], "loss", loss)
        log = live.due(step + 1, last=step + 1 == cfg.steps)
        if log or (step + 1) % cfg.checkpoint_every == 0:
            live.flush()  # every rank: the flush is a collective under torchrun
        if log:
            live.log(step + 1, (step + 1) * batches.batch_tokens, {"loss": curve[-1]["loss"]})
            bar.set_postfix(step=step + 1, loss=curve[-1]["loss"])
        if checkpoint_path is not None and (step + 1) % cfg.checkpoint_every == 0 and distributed.is_main():
            features = {n: t for n, t in student.state_dict().items() if ".dofla." in n}
            torch_save_atomic({"model": features, "optimizer": optimizer.state_dict(),
                               "data": batches.state(), "step": step + 1, "curve": curve,
                               "meta": meta}, checkpoint_path)
        bar.update(batches.batch_tokens)
    bar.close()
    live.flush()
    return curve
