"""A sweep cell that submitit starts as several SLURM tasks joins one torch.distributed group.

Two real processes, each given the variables a SLURM task of a submitit job has (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, the node list, SUBMITIT_EXECUTOR=slurm) and nothing of torch's: dofla's
``distributed.init`` starts a gloo group from them through submitit's own helper, and the two agree
on an all-reduced tensor and on rank 0's object.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("submitit")

ROOT = Path(__file__).resolve().parents[2]
TASK = """
import json, os, torch
import torch.distributed as dist
from dofla import distributed
distributed.init()
total = torch.tensor([float(distributed.rank() + 1)])
if distributed.world() > 1:
    dist.all_reduce(total)
print(json.dumps({"rank": distributed.rank(), "world": distributed.world(), "sum": total.item(),
                  "from_rank0": distributed.broadcast(f"rank {distributed.rank()}"),
                  "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}}))
distributed.finish()
"""
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_env(procid: int, ntasks: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith("SLURM_")}
    env.update(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_NTASKS=str(ntasks), SLURM_JOB_NUM_NODES="1",
               SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost", SLURM_PROCID=str(procid),
               SLURM_LOCALID=str(procid), MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    return env


def _run_tasks(ntasks: int) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TASK], env=_slurm_env(i, ntasks, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(ntasks)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_two_slurm_tasks_of_a_submitit_job_form_one_process_group():
    outs = _run_tasks(2)
    assert [o["rank"] for o in outs] == [0, 1] and {o["world"] for o in outs} == {2}
    assert {o["sum"] for o in outs} == {3.0}  # 1 + 2: each rank's tensor reached the other
    assert {o["from_rank0"] for o in outs} == {"rank 0"}
    assert [o["env"] for o in outs] == [{"RANK": str(i), "WORLD_SIZE": "2", "LOCAL_RANK": str(i),
                                          "MASTER_ADDR": "localhost"} for i in range(2)]


def test_a_single_task_job_stays_one_process():
    (out,) = _run_tasks(1)
    assert (out["rank"], out["world"], out["sum"]) == (0, 1, 1.0) and out["env"]["WORLD_SIZE"] is None
