"""The training loop every trainer runs on (dofla.train.loop), on a toy trainer: a real SIGKILL inside
it and a resume to the same bits, resume keyed by settings, the best state and patience, the
finiteness check and micro-batches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dofla.train.loop import Checkpointing, LoopConfig, Trainer, Unit, run_loop
from dofla.train.step import NonFiniteLossError

ROOT = Path(__file__).resolve().parents[2]


class Regression(Trainer):
    """Two units (two linear maps) fitting y = x·W on random rows of a fixed data set; the held-out
    value is the mean squared error on fixed held-out rows; the row draw is the data position."""

    kill = "toy:step"

    def __init__(self, lr: float = 0.05, poison_at: int | None = None):
        g = torch.Generator().manual_seed(0)
        self.x, self.held = torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randn(16, 6, generator=g,
                                                                                            dtype=torch.float64)
        self.w = torch.randn(6, 3, generator=g, dtype=torch.float64)
        self.units = {}
        for key in ("a", "b"):
            module = torch.nn.Linear(6, 3, dtype=torch.float64)
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)
            self.units[key] = Unit(module, torch.optim.Adam(module.parameters(), lr=lr))
        self.generator, self.batch_tokens, self.poison_at = torch.Generator().manual_seed(1), 8, poison_at

    def next_batch(self, step):
        self.step = step
        return torch.randint(64, (8,), generator=self.generator)

    def loss(self, key, rows):
        x = self.x[rows]
        loss = (self.units[key].module(x) - x @ self.w).pow(2).mean()
        return loss * float("nan") if self.step == self.poison_at else loss

    def heldout(self, key):
        with torch.no_grad():
            return float((self.units[key].module(self.held) - self.held @ self.w).pow(2).mean())

    def data_state(self):
        return self.generator.get_state()

    def restore_data(self, state):
        self.generator.set_state(state)


CFG = LoopConfig(steps=12, warmup_steps=3, eval_every=4, checkpoint_every=5, log_every=4)


def train(checkpoint: str | None, settings: dict | None = None, cfg: LoopConfig = CFG, **kwargs):
    trainer = Regression(**kwargs)
    done = run_loop(trainer, cfg, Checkpointing(Path(checkpoint) if checkpoint else None, settings), progress=False)
    return done, {key: unit.module.state_dict() for key, unit in trainer.units.items()}


def killed_run(checkpoint: Path, point: str) -> subprocess.CompletedProcess:
    script = f"from tests.unit.test_loop import train; train({str(checkpoint)!r}, {{'lr': 0.05}})"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DOFLA_KILL_AT": point, "OMP_NUM_THREADS": "1"})


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def test_a_run_killed_by_sigkill_resumes_to_the_same_bits(tmp_path):
    full, weights = train(None)
    checkpoint = tmp_path / "toy.ckpt"
    killed = killed_run(checkpoint, "toy:step7")
    assert killed.returncode == -9, killed.stderr[-2000:]  # a real SIGKILL, after the checkpoint of step 5
    assert torch.load(checkpoint, weights_only=False)["state"]["step"] == 5
    resumed, resumed_weights = train(str(checkpoint), {"lr": 0.05})
    for key, record in full.records.items():
        assert resumed.records[key]["curve"] == record["curve"] and resumed.records[key]["best"] == record["best"]
    assert same(resumed_weights, weights) and resumed.step == full.step == 12 and resumed.tokens == 12 * 8


def test_a_checkpoint_of_other_settings_is_not_resumed(tmp_path):
    checkpoint = tmp_path / "toy.ckpt"
    train(str(checkpoint), {"lr": 0.05})  # leaves the checkpoint of step 10
    fresh, weights = train(None, lr=0.01)
    other, other_weights = train(str(checkpoint), {"lr": 0.01}, lr=0.01)  # written under lr 0.05: ignored
    assert same(other_weights, weights) and [r["curve"] for r in other.records.values()] == \
        [r["curve"] for r in fresh.records.values()]


def test_every_unit_ends_in_its_best_state_and_stops_when_patience_runs_out():
    cfg = LoopConfig(steps=40, eval_every=2, patience=2, checkpoint_every=100)
    done, weights = train(None, cfg=cfg, lr=0.8)  # a rate that overshoots: the held-out error rises after step 2
    for key, record in done.records.items():
        evaluated = [c for c in record["curve"] if "heldout_loss" in c]
        best = min(evaluated, key=lambda c: c["heldout_loss"])
        assert record["best"] == best["heldout_loss"] < record["initial"] and record["best_step"] == best["step"] + 1
        assert torch.equal(weights[key]["weight"], record["best_state"]["weight"])
        assert len(record["curve"]) < 40 and record["stopped"]  # stopped early, on its own
    assert done.step < 40


def test_a_non_finite_step_fails_naming_it_or_is_skipped():
    with pytest.raises(NonFiniteLossError, match="a: non-finite training loss at step 3"):
        train(None, poison_at=3)
    done, _ = train(None, cfg=LoopConfig(steps=6, skip_nonfinite=True), poison_at=3)
    assert [c.get("skipped", False) for c in done.records["a"]["curve"]] == [False] * 3 + [True] + [False] * 2


def test_micro_batches_add_up_to_the_whole_batch():
    whole, weights = train(None, cfg=LoopConfig(steps=5))
    parts, part_weights = train(None, cfg=LoopConfig(steps=5, micro_batch_size=3))
    for key in weights:
        torch.testing.assert_close(part_weights[key]["weight"], weights[key]["weight"], rtol=1e-12, atol=1e-12)
    assert [c["loss"] for c in parts.records["a"]["curve"]] == pytest.approx(
        [c["loss"] for c in whole.records["a"]["curve"]], rel=1e-12)


class Limited(Regression):
    """Data that runs out after ``batches`` batches; the losses run their own backward, in halves."""

    own_backward = True

    def __init__(self, batches: int):
        super().__init__()
        self.batches = batches

    def next_batch(self, step):
        return None if step >= self.batches else super().next_batch(step)

    def backward(self, key, rows, weight):
        loss = self.loss(key, rows)
        for half in (0.5, 0.5):
            (loss * weight * half).backward(retain_graph=True)
        return loss.detach()


def test_the_loop_ends_where_the_data_runs_out_and_a_trainer_may_run_its_own_backward():
    cfg = LoopConfig(steps=12, warmup_steps=3, checkpoint_every=5)
    limited, reference = Limited(batches=7), Regression()
    done = run_loop(limited, cfg)
    assert done.step == 7 and done.tokens == 7 * 8 and len(done.records["a"]["curve"]) == 7
    run_loop(reference, LoopConfig(steps=7, warmup_steps=3, checkpoint_every=5, schedule=cfg.schedule))
    for key in ("a", "b"):  # the same steps as a loop asked for seven, through autograd's own backward
        for a, b in zip(limited.units[key].module.parameters(), reference.units[key].module.parameters()):
            torch.testing.assert_close(a, b)


def test_clipping_bounds_each_step_and_the_cosine_schedule_ends_at_its_floor():
    clipped, free = Regression(lr=0.5), Regression(lr=0.5)
    cfg = LoopConfig(steps=6, schedule="cosine", checkpoint_every=100)
    run_loop(clipped, LoopConfig(**{**cfg.__dict__, "grad_clip": 1e-3, "lr_floor": 0.1}))
    run_loop(free, cfg)
    assert clipped.units["a"].optimizer.param_groups[0]["lr"] > free.units["a"].optimizer.param_groups[0]["lr"]
    grads = [float(torch.cat([p.grad.flatten() for p in t.units["a"].module.parameters()]).norm())
             for t in (clipped, free)]  # the last step's gradients, as the optimiser saw them
    assert grads[0] <= 1e-3 * (1 + 1e-6) < grads[1]
