"""Peak memory of the train and distill stages, predicted before they run, from a trace of their own step.

The stage's real step code runs twice (the second step holds the optimiser's state) on the CPU, on
copies of the teacher cut to 1 and to 2 layers (random weights, the run's sequence length and
precision), at micro-batches of 1 and 2 sequences, under :class:`PeakTracker`, a dispatch mode
that adds up the bytes of every tensor storage alive and keeps the peak. Memory is affine in the
number of identical layers and in the micro-batch, so the four traces (two when the batch is one
sequence) fix ``peak(layers, micro) = weights + a + b·layers + micro·(c + d·layers)``, where the weights
(every parameter and buffer alive before the step: teacher, capture copy, student, features) are
counted from the full models. What is counted is tensor storage: what a CUDA caching allocator must
hold at least; its fragmentation and the CUDA context are not modelled (the preflight keeps 10 %
and 1 GiB of the device free for them). ``tests/component/test_capacity.py`` checks the
extrapolation against the traced peak of the full step at its real micro-batch.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dofla.train.probe_steps import (  # noqa: F401 - the step builders, also reached from here
    cached_step, cut_to, direct_step, kl_step, model_step, stream_step, task_step, widest_layer)


class PeakTracker(TorchDispatchMode):
    """Bytes of every tensor storage created under it and still alive (``live``), and the peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key in self._seen:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._track(leaf)
        return out


@contextlib.contextmanager
def quiet():
    """Progress bars hidden (``TQDM_DISABLE``) and fault injection off (``DOFLA_KILL_AT``) while a step
    runs only to be traced or counted."""
    saved = {name: os.environ.pop(name, None) for name in ("TQDM_DISABLE", "DOFLA_KILL_AT")}
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def traced_peak(step) -> int:
    """Peak live tensor bytes created while ``step()`` runs (its progress bars hidden)."""
    with quiet(), PeakTracker() as tracker:
        step()
    return tracker.peak


def module_bytes(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad or not trainable_only) \
        + (0 if trainable_only else sum(b.numel() * b.element_size() for b in module.buffers()))


@dataclass
class Peak:
    """A stage's predicted peak at ``micro_batch``: ``fixed`` (weights and optimiser state) plus
    ``micro_batch × per_sample``; ``per_sample`` None: a batch of one sequence, traced only at micro-batch
    1, whose whole peak is ``fixed``."""
    stage: str
    fixed: int
    per_sample: int | None
    micro_batch: int

    @property
    def bytes(self) -> int:
        if self.per_sample is None and self.micro_batch != 1:
            raise ValueError(f"a peak traced at micro-batch 1 only says nothing of micro-batch {self.micro_batch}")
        return self.fixed + self.micro_batch * (self.per_sample or 0)

    def at(self, micro_batch: int) -> "Peak":
        return replace(self, micro_batch=micro_batch)


def _fit(stage: str, trace, layers: int, weights: int, micro_batch: int, batch: int) -> Peak:
    """``trace(depth, micro)``: the traced peak of the step of a ``depth``-layer cut at ``micro`` rows.
    Four traces fix T(n, m) = a + b·n + m·(c + d·n), evaluated at ``layers``; ``weights`` (alive
    before the step: the models' parameters and buffers) is added. A ``batch`` of 1 needs T(n, 1) only."""
    if batch == 1:
        return Peak(stage, weights + max(0, in_depth(trace(1, 1), trace(2, 1), layers)), None, 1)
    t = {(n, m): trace(n, m) for n in (1, 2) for m in (1, 2)}
    per_sample = {n: max(0, t[n, 2] - t[n, 1]) for n in (1, 2)}
    fixed = {n: max(0, t[n, 1] - per_sample[n]) for n in (1, 2)}

    return Peak(stage, weights + max(0, in_depth(fixed[1], fixed[2], layers)),
                max(0, in_depth(per_sample[1], per_sample[2], layers)), micro_batch)


def in_depth(one: float, two: float, layers: int) -> float:
    """A quantity of a stack of identical layers (affine in depth) at ``layers``, from its values at 1 and 2."""
    return one + (layers - 1) * (two - one)


def copy_bytes(teacher, dtype: torch.dtype) -> int:
    """Bytes of the teacher's distillation copy in ``dtype`` (none for float32: the teacher itself runs)."""
    return 0 if dtype == torch.float32 else sum(p.numel() for p in teacher.parameters()) * dtype.itemsize


def stream_step_peak(teacher, feature_maps: list, layers: list[int], cfg, seq_len: int, capture_bytes: int = 0,
                     dtype=torch.float32) -> Peak:
    """The streamed layerwise step (``dofla.train.stream``) of ``layers`` at ``cfg.micro_batch_size``:
    the teacher's weights (and its half-precision capture copy, ``capture_bytes``, whose forward runs
    in ``dtype``), every trained layer's features and their Adam state, one teacher forward's captured
    q, k (v) and one layer's loss."""
    step = stream_step(teacher, feature_maps, layers, cfg, seq_len, dtype)
    weights = module_bytes(teacher) + capture_bytes + sum(module_bytes(feature_maps[i]) for i in layers)
    return _fit("train", lambda depth, micro: traced_peak(step(depth, micro)), len(layers), weights,
                cfg.micro_batch_size or cfg.batch_size, cfg.batch_size)


def cached_step_peak(teacher, feature_maps: list, layers: list[int], cfg, seq_len: int, geometry) -> Peak:
    """The layerwise step on cached activations (``dofla.train.layerwise``, one layer at a time) at
    ``cfg.micro_batch_size``: the teacher's weights (it stays loaded), every layer's features, and
    one layer's batch of q, k (v) and its loss with the Adam state of the widest layer."""
    step = cached_step(feature_maps, layers, cfg, seq_len, geometry)
    weights = module_bytes(teacher) + sum(module_bytes(feature_maps[i]) for i in layers)
    return _fit("train", lambda depth, micro: traced_peak(step(depth, micro)), 1, weights,
                cfg.micro_batch_size or cfg.batch_size, cfg.batch_size)


def direct_step_peak(student_of, teacher, layers: int, cfg, seq_len: int, weights: int) -> Peak:
    """End-to-end (``direct``) training at ``cfg.micro_batch_size``; ``student_of(model)`` converts a
    cut teacher into its student; ``weights``: the teacher's and the student's bytes (both stay loaded)."""
    step = direct_step(student_of, teacher, cfg, seq_len)
    return _fit("train", lambda depth, micro: traced_peak(step(depth, micro)), layers, weights,
                cfg.micro_batch_size or cfg.batch_size, cfg.batch_size)


def task_step_peak(models_of: list, teacher, layers: int, seq_len: int, precision: str, weights: int,
                   micro_batch: int, batch_size: int) -> Peak:
    """The task fine-tune of the largest of the models ``models_of`` builds from a cut teacher (each
    traced; the larger weights-and-state and per-sequence terms kept); ``weights``: every model loaded
    while it runs, the working copy included."""
    peaks = [_fit("eval", lambda depth, micro, step=task_step(of, teacher, seq_len, precision):
                  traced_peak(step(depth, micro)), layers, weights, micro_batch, batch_size) for of in models_of]
    per_sample = [p.per_sample for p in peaks if p.per_sample is not None]
    return Peak("eval", max(p.fixed for p in peaks), max(per_sample) if per_sample else None, micro_batch)


def kl_step_peak(student_of, teacher, layers: int, schedule, train: list[str], lora: tuple[int, int],
                 seq_len: int, weights: int, batch_size: int) -> Peak:
    """The distill stage (:func:`kl_step`) at ``schedule.micro_batch_size``; ``weights``: the teacher's and
    the student's bytes."""
    step = kl_step(student_of, teacher, schedule, train, lora, seq_len)
    return _fit("distill", lambda depth, micro: traced_peak(step(depth, micro)), layers, weights,
                schedule.micro_batch_size or batch_size, batch_size)


def largest_fitting(peak: Peak, batch_size: int, limit: int) -> int | None:
    """The largest micro-batch dividing ``batch_size`` whose peak is under ``limit`` (None: not even 1)."""
    fitting = [m for m in range(1, batch_size + 1) if batch_size % m == 0 and peak.at(m).bytes <= limit]
    return max(fitting) if fitting else None


def usable(total: int) -> int:
    """What the preflight plans against on a GPU of ``total`` bytes: 10 % and 1 GiB are kept free for the
    CUDA context, cuBLAS workspaces and the allocator's fragmentation."""
    return int(total * 0.9) - 2**30


def device_memory(device: torch.device) -> int:
    """Bytes the preflight plans against: on a GPU, what this process can have, i.e. the free memory
    plus what its own allocator already holds (its models, which the prediction counts), at most the
    total less 10 % and 1 GiB (the CUDA context, cuBLAS workspaces, the allocator's fragmentation):
    another process on the same GPU shrinks it. On the CPU, the host's available memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return min(usable(total), free + torch.cuda.memory_reserved(device))
    try:
        with open("/proc/meminfo") as handle:
            info = dict(line.split(":", 1) for line in handle)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
