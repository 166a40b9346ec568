"""Data-parallel streamed layerwise training, two real gloo processes against one process.

Each rank runs the teacher on its half of every batch (counted by a hook on the teacher), each layer's
gradients are averaged over the ranks, and the features land where one process at the whole batch
lands (one thread everywhere, so the matmuls agree; the all-reduce only reorders additions).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.train.stream import train_layers_streaming
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


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(_train(True, os.path.join(out, "stream.ckpt")), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_take_one_process_steps_at_the_same_batch(tmp_path):
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _train(False)
    finally:
        torch.set_num_threads(threads)
    # each rank's teacher saw half of every batch, one micro-batch row at a time
    assert alone["rows"] == [1] * (STEPS * BATCH)
    assert all(r["rows"] == [1] * (STEPS * BATCH // 2) for r in ranks)
    assert all(r["tokens"] == alone["tokens"] == STEPS * BATCH * 32 for r in ranks)
    for i in range(3):
        a, b = ranks[0]["states"][i], ranks[1]["states"][i]
        assert all(torch.equal(a[k], b[k]) for k in a)  # the ranks hold the same features
        # Adam's normalised steps carry the float rounding of the gradients: equal to 1e-5 of the scale
        assert all((a[k] - alone["states"][i][k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a)
        # the logged loss is the whole batch's (the mean over the ranks), and rank 0's held-out value rules
        assert ranks[1]["curves"][i] == ranks[0]["curves"][i]
        assert torch.allclose(torch.tensor(ranks[0]["curves"][i]), torch.tensor(alone["curves"][i]), rtol=1e-4)
        assert ranks[1]["heldout"][i] == ranks[0]["heldout"][i]
        assert abs(ranks[0]["heldout"][i] - alone["heldout"][i]) <= 1e-4 * abs(alone["heldout"][i])
    # rank 0 wrote the checkpoint of the finished run
    saved = torch.load(tmp_path / "stream.ckpt", weights_only=False)
    assert saved["state"]["step"] == STEPS
