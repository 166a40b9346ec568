"""Data parallelism inside the trainers, two real gloo processes against one process.

Streamed layerwise training and KL distillation: each rank runs the teacher on its half of every
batch (counted by a hook on the teacher), the gradients are averaged over the ranks, and the
parameters land where one process at the whole batch lands (one thread everywhere, so the matmuls
agree; the all-reduce only reorders additions).
"""
from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train.direct import RandomRows
from dofla.train.distill import train_kl
from dofla.train.stream import train_layers_streaming
from tests.component.test_distill import SCHEDULE, pair, tokens
from tests.component.test_stream import config, feature_maps, heldout, stream

STEPS, BATCH = 6, 4


def _train(data_parallel: bool, checkpoint=None) -> dict:
    tokenizer = build_byte_tokenizer()
    teacher = build_tiny_model("llama", seed=0, num_layers=3)
    held = heldout(teacher, tokenizer)
    rows = []  # rows of every teacher forward the trainer makes
    teacher.register_forward_pre_hook(lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                      with_kwargs=True)
    maps = feature_maps()
    result = train_layers_streaming(teacher, stream(tokenizer, batch_size=BATCH), maps, [0, 1, 2],
                                    config(batch_size=BATCH, micro_batch_size=1, log_every=2), held, checkpoint,
                                    steps=STEPS, progress=False, data_parallel=data_parallel)
    return {"states": [m.state_dict() for m in maps], "rows": rows, "tokens": result.tokens,
            "curves": {i: [p["loss"] for p in s["curve"]] for i, s in result.summaries.items()},
            "heldout": {i: s["final_heldout_loss"] for i, s in result.summaries.items()}}


def _distil(data_parallel: bool, checkpoint=None) -> dict:
    teacher, student = pair()
    rows = []
    teacher.register_forward_pre_hook(lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                      with_kwargs=True)
    schedule = dataclasses.replace(SCHEDULE, steps=6, micro_batch_size=1, checkpoint_every=4)
    student, curve, used = train_kl(student, teacher, RandomRows(tokens(), BATCH, seed=0), ["features", "attention"],
                                    schedule, checkpoint_path=checkpoint, meta={"run": "dp"},
                                    data_parallel=data_parallel)
    return {"states": [student.state_dict()], "rows": rows, "tokens": used, "curve": [c["kl"] for c in curve]}


WORK = {"stream": _train, "distil": _distil}


def _rank(rank: int, world: int, port: int, out: str, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(WORK[work](True, os.path.join(out, "ckpt.pt")), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _two_and_one(tmp_path, work: str):
    """(each rank's result under two gloo processes, the one-process result), all on one thread."""
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path), work), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ranks, WORK[work](False)
    finally:
        torch.set_num_threads(threads)


def _close(a: dict, b: dict, scale: float = 1e-5) -> bool:
    """Every tensor of state dict ``a`` within ``scale`` of its largest entry of ``b``'s (Adam's
    normalised steps carry the float rounding of the gradients)."""
    return all((a[k].double() - b[k].double()).abs().max() <= scale * b[k].abs().max().clamp_min(1e-12) for k in a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_stream_one_process_steps_at_the_same_batch(tmp_path):
    ranks, alone = _two_and_one(tmp_path, "stream")
    # each rank's teacher saw half of every batch, one micro-batch row at a time
    assert alone["rows"] == [1] * (STEPS * BATCH)
    assert all(r["rows"] == [1] * (STEPS * BATCH // 2) for r in ranks)
    assert all(r["tokens"] == alone["tokens"] == STEPS * BATCH * 32 for r in ranks)
    for i in range(3):
        a, b = ranks[0]["states"][i], ranks[1]["states"][i]
        assert all(torch.equal(a[k], b[k]) for k in a)  # the ranks hold the same features
        assert _close(a, alone["states"][i])
        # the logged loss is the whole batch's (the mean over the ranks), and rank 0's held-out value rules
        assert ranks[1]["curves"][i] == ranks[0]["curves"][i]
        assert torch.allclose(torch.tensor(ranks[0]["curves"][i]), torch.tensor(alone["curves"][i]), rtol=1e-4)
        assert ranks[1]["heldout"][i] == ranks[0]["heldout"][i]
        assert abs(ranks[0]["heldout"][i] - alone["heldout"][i]) <= 1e-4 * abs(alone["heldout"][i])
    # rank 0 wrote the checkpoint of the finished run
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert saved["state"]["step"] == STEPS


def test_two_gloo_processes_distil_one_process_steps_at_the_same_batch(tmp_path):
    ranks, alone = _two_and_one(tmp_path, "distil")
    assert alone["rows"] == [1] * (6 * BATCH) and all(r["rows"] == [1] * (6 * BATCH // 2) for r in ranks)
    assert all(r["tokens"] == alone["tokens"] == 6 * BATCH * 32 for r in ranks)
    a, b = ranks[0]["states"][0], ranks[1]["states"][0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _close(a, alone["states"][0])
    assert ranks[0]["curve"] == ranks[1]["curve"]  # the batch's KL: the mean over the ranks
    assert torch.allclose(torch.tensor(ranks[0]["curve"]), torch.tensor(alone["curve"]), rtol=1e-4)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["state"]["step"] == 4  # rank 0 wrote it
