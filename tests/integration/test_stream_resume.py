"""SIGKILL streaming training mid-run, run it again, get the uninterrupted run's features bit for bit.

The run is a real subprocess (tiny Llama, byte tokenizer, a ``text_files`` JSONL source) that
``DOFLA_KILL_AT=stream:step5`` kills at the start of step 5; checkpoints are every 2 steps, so
the second run resumes from step 4 and must re-serve the same data from there.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import sys
import torch
from dofla.data.prepared import source_stream
from dofla.data import pack_tokens
from dofla.feature_maps import build_feature_map
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train.layerwise import LayerTrainConfig
from dofla.train.stream import train_layers_streaming
from dofla.train.teacher_acts import teacher_heldout

torch.set_num_threads(1)
data, ckpt, out, micro = sys.argv[1:5]
teacher, tokenizer = build_tiny_model("llama", seed=0, num_layers=3), build_byte_tokenizer()
batches = source_stream("text_files", {"paths": [data], "heldout_fraction": 0.1}, tokenizer, 2, 32)
held_rows = pack_tokens(iter(["held out text about light and water"] * 4), tokenizer, 32, 64)
heldout = teacher_heldout(teacher, held_rows, [0, 1, 2])
maps = [build_feature_map("learned_prf", 4, 16, 16, seed=i) for i in range(3)]
cfg = LayerTrainConfig(batch_size=2, warmup_steps=2, eval_every=3, checkpoint_every=2, schedule="cosine",
                       micro_batch_size=int(micro) or None)
result = train_layers_streaming(teacher, batches, maps, [0, 1, 2], cfg, heldout, ckpt, num_tokens=9 * 64)
torch.save({"states": [m.state_dict() for m in maps], "summaries": result.summaries,
            "tokens": result.tokens}, out)
"""

WORDS = "in the beginning god created heaven and earth darkness was upon face of deep".split()


def _write_data(path) -> None:
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))})
             for _ in range(80)]
    path.write_text("\n".join(lines) + "\n")


def _run(tmp_path, name: str, kill_at: str | None = None, micro: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DOFLA_KILL_AT", None)
    if kill_at:
        env["DOFLA_KILL_AT"] = kill_at
    args = [str(tmp_path / "data.jsonl"), str(tmp_path / f"{name}.ckpt"), str(tmp_path / f"{name}.pt"), str(micro)]
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_killed_streaming_run_resumes_to_identical_features(tmp_path):
    _write_data(tmp_path / "data.jsonl")
    baseline = _run(tmp_path, "baseline")
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    killed = _run(tmp_path, "resumed", kill_at="stream:step5")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert not (tmp_path / "resumed.pt").exists()
    assert torch.load(tmp_path / "resumed.ckpt", weights_only=False)["state"]["step"] == 4
    resumed = _run(tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = torch.load(tmp_path / "baseline.pt", weights_only=False)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert got["tokens"] == want["tokens"] == 9 * 64
    for layer, (a, b) in enumerate(zip(want["states"], got["states"])):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), layer
    for layer, summary in want["summaries"].items():
        resumed_summary = got["summaries"][layer]
        for key in ("curve", "best_step", "initial_heldout_loss", "final_heldout_loss", "steps_run"):
            assert resumed_summary[key] == summary[key], (layer, key)


@pytest.mark.long
def test_a_run_resumed_at_another_micro_batch_continues_from_its_checkpoint(tmp_path):
    """A requeued job on another GPU may get another ``micro_batch_size=auto``: the micro-batch changes
    the peak memory, not what is learnt, so the checkpoint is resumed (equal up to float rounding)."""
    _write_data(tmp_path / "data.jsonl")
    baseline = _run(tmp_path, "baseline")
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    killed = _run(tmp_path, "resumed", kill_at="stream:step5")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = _run(tmp_path, "resumed", micro=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "other settings" not in resumed.stdout  # the checkpoint was taken, not ignored
    want = torch.load(tmp_path / "baseline.pt", weights_only=False)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert got["tokens"] == want["tokens"]
    assert got["summaries"][0]["curve"][:2] == want["summaries"][0]["curve"][:2]  # the steps before the kill
    for a, b in zip(want["states"], got["states"]):
        assert all(torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-6) for n in a)
