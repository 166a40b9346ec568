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

from dofla import distributed
from dofla.train.layerwise import LayerTrainConfig, param_groups
from dofla.train.live import Log
from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, run_loop
from dofla.train.losses import next_token_loss


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


class DirectStudent(Trainer):
    """The whole student's next-token loss, every layer's features one unit (the student's other weights
    frozen); batches from a token tensor's random rows or a stream, whose position is the data state;
    no held-out evaluation (the final state is kept)."""

    autocast, kill = True, "train:direct:step"

    def __init__(self, student, batches, cfg: LayerTrainConfig):
        groups = feature_param_groups(student, cfg)
        optimizer = torch.optim.Adam(groups, weight_decay=0.0) if groups else None
        self.units = {"student": Unit(student, optimizer, keep=lambda name: ".dofla." in name)}
        self.student, self.batches, self.batch_tokens = student, batches, batches.batch_tokens
        self.device = next(student.parameters()).device

    def next_batch(self, step: int) -> torch.Tensor:
        return distributed.my_rows(self.batches.next_batch().to(self.device))  # torchrun: this rank's part

    def loss(self, key, rows: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.student, rows)

    def data_state(self):
        return self.batches.state()

    def restore_data(self, state) -> None:
        self.batches.restore(state)

    def log_values(self, curves) -> dict:
        return {"loss": curves["student"][-1]["loss"]}

    def message(self, key, step: int) -> str:
        return f"direct training: non-finite loss at step {step}"


def train_direct(student, tokens, cfg: LayerTrainConfig, checkpoint_path: Path | None = None,
                 meta: dict | None = None, on_log: Log | None = None, progress: bool = True) -> list[dict]:
    """Next-token training of the student's feature maps; returns the curve.

    ``tokens``: a (S, L) tensor (``cfg.steps`` steps of ``cfg.batch_size`` random rows), or a batch
    source like ``RandomRows`` (``next_batch()``, ``state()``, ``restore()``, ``batch_tokens``) such
    as a ``BatchStream`` (then ``cfg.steps`` steps of its batches, in order). The checkpoint
    records ``meta`` (the settings) and the source's position; one written with other settings is
    ignored. ``on_log`` gets the loss, tokens/s and ETA every ``cfg.log_every`` steps; ``progress=False``
    hides the bar (the memory preflight's probe steps). The loop is :func:`dofla.train.loop.run_loop`'s;
    under torchrun every rank trains on its rows of each batch.
    """
    batches = RandomRows(tokens, cfg.batch_size, cfg.seed + 1) if isinstance(tokens, torch.Tensor) else tokens
    trainer = DirectStudent(student, batches, cfg)
    # eval mode: the frozen network's dropout would only add noise to the target the features chase
    student.eval()
    done = run_loop(trainer, LoopConfig.of(cfg, eval_every=0), Checkpointing(checkpoint_path, meta), on_log,
                    data_parallel=True, desc="train (direct)", progress=progress)
    return done.records["student"]["curve"]
