"""Data parallelism through torchrun (``torch.distributed``), the same configs as one process.

``torchrun --nproc_per_node=N -m dofla ...`` (or several nodes with torchrun's usual rendezvous
flags) starts N copies of the pipeline. :func:`init` joins them into one process group (NCCL on
GPUs, gloo on CPUs). Then:

- the activation cache is built once: rank 0 creates the files, every rank runs the teacher on
  its share of the batches and writes its rows, rank 0 seals the manifest;
- layerwise training from a stream splits every batch over the ranks and averages each layer's
  gradients (``train.parallel=data``, the default for a stream): N ranks, 1/N of a step's teacher and
  loss work each; from the cache (or with ``train.parallel=layers``) it spreads the layers over the
  ranks instead (layer i on rank i mod N);
- ``direct`` training splits every batch across the ranks and averages the gradients, so each step
  is the single-process step on the same batch;
- perplexity and attention error sum their per-batch terms across ranks;
- everything else (Algorithm 1, allocation, assembly, lm-eval tasks, reports) runs on rank 0 while
  the others wait, and every file is written by rank 0 alone.

A sweep cell that the submitit SLURM launcher starts as several tasks (``hydra/launcher=slurm_gpu
hydra.launcher.gpus_per_node=N``: one task per GPU) joins the same way: submitit's own
``TorchDistributedEnvironment`` turns the task's SLURM variables into torch's (RANK, WORLD_SIZE,
MASTER_ADDR, ...) before the process group starts.

A single process (no torchrun) takes none of these paths: every helper here is then a no-op.
"""
from __future__ import annotations

import contextlib
import os
import re
from datetime import timedelta
from typing import Any, Iterable, TypeVar

import torch
import torch.distributed as dist

from dofla.errors import require

try:  # the launchers extra; a submitit job always has it (~50 ms to import)
    from submitit.helpers import TorchDistributedEnvironment
except ImportError:
    TorchDistributedEnvironment = None

T = TypeVar("T")


def init() -> None:
    """Join the process group when started by torchrun (WORLD_SIZE > 1) or as one of several tasks of
    a submitit SLURM job; otherwise do nothing."""
    if submitit_tasks() > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        # every task sees the node's GPUs (set_device below picks its own), and SLURM's values win
        # over any RANK / MASTER_* inherited from the submitting shell
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    # Ranks wait for each other while one trains its layers: allow hours, not the default 30 min.
    timeout = timedelta(minutes=float(os.environ.get("DOFLA_DIST_TIMEOUT_MIN", "720")))
    if torch.cuda.is_available():
        # modulo: a SLURM job that binds one GPU to each task shows every task a single device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def submitit_tasks() -> int:
    """How many tasks this process's submitit SLURM job has (0 outside one)."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or TorchDistributedEnvironment is None:
        return 0
    return int(os.environ.get("SLURM_NTASKS", "1"))


def device(spec: str = "auto") -> torch.device:
    """The device the models run on: ``spec`` (``cpu``, ``cuda``, ``cuda:N``), or for ``auto`` the
    GPU when one is visible (under torchrun this rank's, set by :func:`init`), else the CPU."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(spec)


def check_device(spec: str) -> None:
    """``spec`` is auto, cpu, cuda or cuda:N; a GPU only if visible; and ``auto`` does not quietly run
    on the CPU in a SLURM job that was given GPUs (a CPU-only torch build on a GPU node)."""
    require(spec in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", str(spec)) is not None,
            f"device={spec!r} must be auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count()
    slurm = os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_JOB_GPUS")
    require(not spec.startswith("cuda") or int(spec.partition(":")[2] or 0) < count,
            f"device={spec} but this machine sees {count} CUDA GPU(s); use device=auto or device=cpu")
    require(spec != "auto" or count > 0 or not slurm, f"this SLURM job was given GPUs ({slurm}) but torch sees none "
            "(a CPU-only torch build?); install your CUDA's torch wheel (docs/install.md) or set device=cpu")


_ALONE = False


@contextlib.contextmanager
def alone():
    """Within it this process acts as if it ran alone (world 1, rank 0): no collective is called, so
    each rank may run work the others do not (the memory preflight's trace) without waiting on them."""
    global _ALONE
    before, _ALONE = _ALONE, True
    try:
        yield
    finally:
        _ALONE = before


def world() -> int:
    return 1 if _ALONE or not dist.is_initialized() else dist.get_world_size()


def rank() -> int:
    return 0 if _ALONE or not dist.is_initialized() else dist.get_rank()


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def splits_batches(parallel: str, source: str) -> bool:
    """Whether layerwise training splits each batch over the ranks (``train.parallel=data``, or auto on a
    stream) rather than the layers (``layers``, or auto on the cache); ``source`` may still be ``auto``."""
    return parallel == "data" or (parallel == "auto" and source == "stream")


def my_rows(batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a batch split over the ranks (rows rank, rank + world, ...)."""
    return batch[rank()::world()]


def mine(items: Iterable[T]) -> list[T]:
    """This rank's share of ``items`` (item n goes to rank n mod world)."""
    return [item for n, item in enumerate(items) if n % world() == rank()]


def sum_across(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64, so the order barely matters)."""
    if world() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def mean_across(values: list[float]) -> list[float]:
    """Element-wise mean of ``values`` over all ranks (a logged loss of a batch split over them)."""
    return [v / world() for v in sum_across(values)]


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each gradient by its mean over the ranks (DDP's all-reduce, done by hand)."""
    if world() == 1:
        return
    for p in params:
        if p.grad is None:  # every rank must join every all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world())


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def finish() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main_first(fn, *args, **kwargs):
    """Run ``fn`` on rank 0, then on the others (which then find its artifacts and just read them).

    A failure on rank 0 reaches the other ranks as an error instead of leaving them waiting.
    """
    if world() == 1:
        return fn(*args, **kwargs)
    if is_main():
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:
            broadcast(f"{type(err).__name__}: {err}")
            raise
        broadcast(None)
        return result
    failure = broadcast(None)
    if failure is not None:
        raise RuntimeError(f"rank 0 failed ({failure}); see its output")
    return fn(*args, **kwargs)


def all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every rank."""
    return sum_across([float(bool(flag))])[0] == world()
