"""The cost model's parts per op (:mod:`studies.cost_model`, :mod:`studies.cost_sweep`): the GPUs it prices,
an op's seconds on one (its matmul FLOPs at the peak for its dtype, the other ops' traffic at the memory
bandwidth), the ops of a step counted on 1- and 2-layer cuts, and a cell's cost."""
from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.counting import Op, StepCounter
from dofla.models import convert
from dofla.train import capacity
from studies.paper_memory import Teacher


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes, nominal
    bandwidth: float  # HBM bytes/s
    peaks: dict  # dense matmul FLOP/s by kind: float64, float32 (no TF32), tf32, bfloat16


GPUS = [Gpu("H100 SXM 80GB", 80 * 10**9, 3.35e12,
            {"float64": 67e12, "float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12}),
        Gpu("A100 SXM 80GB", 80 * 10**9, 2.039e12,
            {"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12})]


def peak_for(gpu: Gpu, kind: str, precision: str) -> float:
    """The matmul peak an op of dtype ``kind`` gets under ``precision`` (tf32 turns float32 into TF32)."""
    kind = {"float16": "bfloat16"}.get(kind, kind)
    return gpu.peaks["tf32" if kind == "float32" and precision == "tf32" else kind]


@dataclass
class Seconds:
    """One step's GPU seconds: matmul FLOPs at peak (divide by MFU), the other ops' traffic, the floor."""
    matmul: float
    traffic: float
    floor: float

    def predicted(self, mfu: float) -> float:
        return self.matmul / mfu + self.traffic


def seconds(ops: list[Op], gpu: Gpu, precision: str) -> Seconds:
    matmul = sum(op.flops / peak_for(gpu, op.kind, precision) for op in ops if op.flops)
    traffic = sum(2 * op.written / gpu.bandwidth for op in ops if not op.flops)
    floor = sum(max(op.flops / peak_for(gpu, op.kind, precision) if op.flops else 0.0, 2 * op.written / gpu.bandwidth)
                for op in ops)
    return Seconds(matmul, traffic, floor)


def counted(step) -> list[Op]:
    """The ops of ``step()`` (one training step of a cut)."""
    with capacity.quiet(), StepCounter() as counter:
        step()
    return counter.ops


COUNTED: dict = {}  # (teacher, step, precision) -> {depth: ops}, for tf32 to reuse fp32's


def counted_cuts(step, key: tuple) -> dict[int, list[Op]]:
    """The ops of ``step(n, 1)`` for n = 1, 2; tf32 changes no tensor and no dtype (only the GPU's
    matmul mode), so its ops are fp32's, counted once."""
    teacher, name, precision = key
    if precision == "tf32" and (teacher, name, "fp32") in COUNTED:
        return COUNTED[teacher, name, "fp32"]
    COUNTED[key] = {n: counted(step(n, 1)) for n in (1, 2)}
    return COUNTED[key]


@dataclass
class CellCost:
    teacher: Teacher
    loss: str
    precision: str
    flops: dict  # per token, by dtype, whole model
    written: float  # bytes per token, whole model
    per_gpu: dict  # gpu name -> Seconds per token, whole model
    peak: capacity.Peak | None = None
    count_seconds: float = 0.0
    fits: dict = field(default_factory=dict)  # gpu name -> micro-batch auto picks (None: not even 1)


def student_of(t: Teacher):
    """``direct``'s student of a cut teacher: learned PRF at the cell's budget in every layer."""
    return lambda cut: convert(cut, feature_map="learned_prf", dims=[t.budget] * cut.config.num_hidden_layers)


def fmt_time(hours: float) -> str:
    return f"{hours:.2f} h" if hours < 48 else f"{hours / 24:.1f} d"
