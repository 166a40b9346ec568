"""Live curves: every trainer reports its latest losses, tokens, tokens/s and ETA every
``log_every`` steps while it runs, and what it reports is what its curve keeps."""
from __future__ import annotations

import math
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dofla.feature_maps import build_feature_map
from dofla.models import convert
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train import LayerTrainConfig, train_direct, train_layer
from dofla.train.live import Live, latest
from dofla.train.step import Accumulator, NonFiniteLossError
from dofla.train.stream import train_layers_streaming
from tests.component.test_stream import heldout, stream
from tests.component.test_train import realistic_qk


def test_held_values_reach_their_entries_at_the_flush_and_non_finite_ones_become_none():
    live = Live(None, every=3, total=100)
    entries = [{"step": i, "loss": None} for i in range(3)]
    for entry, value in zip(entries, (0.5, float("nan"), 2.0)):
        live.hold(entry, "loss", torch.tensor(value))
    assert all(e["loss"] is None for e in entries)  # nothing read back before the flush
    live.flush()
    assert [e["loss"] for e in entries] == [0.5, None, 2.0] and not live.pending
    halved = Live(None, every=1, total=1, reduce=lambda values: [v / 2 for v in values])
    entry = {}
    halved.hold(entry, "loss", torch.tensor(3.0, dtype=torch.float64))
    halved.flush()
    assert entry["loss"] == 1.5


def test_a_log_carries_step_tokens_rate_and_eta_under_the_prefix():
    logged = []
    live = Live(logged.append, every=4, total=1000, tokens=100)
    assert [s for s in range(1, 10) if live.due(s)] == [4, 8] and live.due(9, last=True)
    live.started -= 2.0  # two seconds for 200 tokens: 100 tokens/s, 700 left
    live.log(3, 300, {"loss": 0.25})
    (out,) = logged
    assert out["train/loss"] == 0.25 and out["train/step"] == 3 and out["train/tokens"] == 300
    assert out["train/tokens_per_s"] == pytest.approx(100, rel=0.05)
    assert out["train/eta_min"] == pytest.approx(700 / 100 / 60, rel=0.05)


def test_latest_names_each_layers_last_losses_and_their_mean():
    curves = {3: [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5, "heldout_loss": 0.7}],
              10: [{"step": 1, "loss": 1.5}], 4: []}
    assert latest(curves) == {"layer_03/loss": 0.5, "layer_03/heldout_loss": 0.7, "layer_10/loss": 1.5,
                              "loss_mean": 1.0}


def test_streamed_training_logs_every_layer_every_log_every_steps_as_its_curve_records():
    teacher = build_tiny_model("llama", seed=0, num_layers=3)
    tokenizer = build_byte_tokenizer()
    maps = [build_feature_map("learned_prf", 4, 16, 16, seed=i) for i in range(3)]
    logged = []
    cfg = LayerTrainConfig(batch_size=2, warmup_steps=2, eval_every=5, log_every=2)
    result = train_layers_streaming(teacher, stream(tokenizer), maps, [0, 2], cfg, heldout(teacher, tokenizer, (0, 2)),
                                    steps=7, on_log=logged.append, progress=False)
    assert [out["train/step"] for out in logged] == [2, 4, 6, 7]
    assert [out["train/tokens"] for out in logged] == [s * 64 for s in (2, 4, 6, 7)]
    for out in logged:
        for i in (0, 2):
            entry = result.summaries[i]["curve"][out["train/step"] - 1]
            assert out[f"train/layer_{i:02d}/loss"] == entry["loss"]
        assert "train/layer_01/loss" not in out and out["train/eta_min"] >= 0
    assert logged[-1]["train/layer_02/heldout_loss"] == result.summaries[2]["curve"][-1]["heldout_loss"]
    for summary in result.summaries.values():  # floats in the curve, not device tensors
        assert all(type(entry["loss"]) is float and math.isfinite(entry["loss"]) for entry in summary["curve"])


def test_cached_layer_training_logs_its_layer_under_its_own_name():
    q, k = realistic_qk()
    logged = []
    cfg = LayerTrainConfig(steps=9, eval_every=4, warmup_steps=2, log_every=4, batch_size=2)
    result = train_layer(build_feature_map("learned_prf", 3, 16, 16, seed=0), q, k, cfg, layer=5,
                         on_log=logged.append)
    assert [out["train/step"] for out in logged] == [4, 8, 9]
    assert [out["train/layer_05/loss"] for out in logged] == [result.curve[s - 1]["loss"] for s in (4, 8, 9)]
    assert logged[0]["train/tokens"] == 4 * 2 * q.shape[2]


def test_direct_training_logs_the_batch_loss_its_curve_keeps():
    student = convert(build_tiny_model("llama"), feature_map="learned_prf", dims=[8, 8])
    tokens = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(0))
    logged = []
    curve = train_direct(student, tokens, LayerTrainConfig(steps=5, batch_size=3, warmup_steps=2, log_every=3),
                         on_log=logged.append)
    assert [(out["train/step"], out["train/loss"]) for out in logged] == [(3, curve[2]["loss"]),
                                                                           (5, curve[4]["loss"])]
    assert all(type(c["loss"]) is float for c in curve)


def test_one_non_finite_micro_batch_skips_the_whole_step():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    step = Accumulator(optimizer)
    step.add((weight * 2).sum(), 0.5)
    step.add((weight * float("inf")).sum(), 0.5)
    step.add((weight * 3).sum(), 0.0)
    assert step.step("test", skip_nonfinite=True) is None
    assert torch.equal(weight.detach(), torch.ones(3)) and weight.grad is None
    step = Accumulator(optimizer)
    step.add((weight * float("nan")).sum())
    with pytest.raises(NonFiniteLossError, match="test; lower the learning rates"):
        step.step("test", skip_nonfinite=False)


class HostReads(TorchFunctionMode):
    """Counts reads of a tensor's value into Python (each one a host synchronisation on a GPU), by
    the file that asked for it; not Adam's own step counters (host tensors by design)."""

    READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__}

    def __init__(self):
        super().__init__()
        self.by_file: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        stack = traceback.extract_stack()[:-1]
        if func in self.READS and "torch/optim" not in stack[-1].filename:
            caller = next(f for f in reversed(stack) if "torch/" not in f.filename)
            name = caller.filename.rsplit("/", 1)[-1]
            self.by_file[name] = self.by_file.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss", ["softmax", "output"])
def test_the_streamed_step_reads_the_device_once_per_layer_and_logs_in_one_read(loss):
    """The trainer's own loop: one combined finiteness check per layer per step, whatever the number
    of micro-batches, and one read per log point for every held loss; the chunked kernel's fast path
    costs no read for its causal limits (only its per-chunk guard decision)."""
    teacher = build_tiny_model("llama", seed=0, num_layers=3)
    tokenizer = build_byte_tokenizer()
    held = heldout(teacher, tokenizer, (0, 1, 2))
    maps = [build_feature_map("learned_prf", 4, 16, 16, seed=i) for i in range(3)]
    cfg = LayerTrainConfig(batch_size=4, micro_batch_size=1, warmup_steps=2, eval_every=100, log_every=3, loss=loss)
    with HostReads() as reads:
        train_layers_streaming(teacher, stream(tokenizer, batch_size=4), maps, [0, 1, 2], cfg, held, steps=6,
                               progress=False, on_log=lambda values: None)
    assert reads.by_file["step.py"] == 3 * 6  # layers × steps, not × micro-batches
    assert reads.by_file["live.py"] == 2  # steps 3 and 6
    assert "stream.py" not in reads.by_file and "layerwise.py" in reads.by_file  # held-out evaluation only
    # one guard decision per kernel block (one block at L=32): 3 layers × 6 steps × 4 micro-batches,
    # plus each layer's first and last held-out evaluation
    assert reads.by_file["stable.py"] == 3 * 6 * 4 + 3 * 2
