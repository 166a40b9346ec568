"""The checks of ``dofla-gpucheck`` (:mod:`dofla.gpucheck`): one paper cell's step on this device, timed,
its memory measured beside the preflight's prediction, its host synchronisations counted; the sweeps'
projected hours; the ``gpu``-marked tests."""
from __future__ import annotations

import collections
import math
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from transformers import GPT2Config, GPTNeoXConfig
from transformers import AutoModelForCausalLM

import dofla
from dofla.eval.downstream import TRAIN_EXAMPLES
from dofla.feature_maps.blocks import build_layer_feature_map
from dofla.measure import peak_memory
from dofla.models.student import convert
from dofla.precision import configure_matmul, teacher_dtype
from dofla.train import capacity, probe_steps
from dofla.train.capacity import quiet
from dofla.train.layerwise import LayerTrainConfig

PAPER_TOKENS = 362e6  # distillation tokens of a paper cell: one pass over 10 % of English Wikipedia
GRID = 6  # learning rates of the teacher's grid (eval.finetune_lr_grid of the paper experiments)
EPOCHS = {task: 1 if task == "mmlu" else 3 for task in TRAIN_EXAMPLES}
# the paper sweeps (experiment=paper_gpt2, paper_pythia1b): cells per distillation loss; every cell
# fine-tunes its student on the seven tasks, and the teacher's grid runs once per sweep. Performer and
# DiJiang train no features: their cells cost the task fine-tunes only
SWEEPS = {"gpt2": {"direct": 3, "softmax": 3, "l2": 3, "cells": 11}, "pythia-1b": {"softmax": 2, "cells": 2}}
SYNCS = {"__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__"}
PEAKS: dict = {}  # (cell, precision) -> the preflight's Peak, traced once per process


@dataclass(frozen=True)
class Cell:
    teacher: str  # gpt2 | pythia-1b
    stage: str  # distill:softmax | distill:l2 | distill:direct | finetune
    seq_len: int
    budget: int  # C: the features per head
    batch: int


CELLS = [*(Cell("gpt2", f"distill:{loss}", 1024, 64, 128) for loss in ("softmax", "l2", "direct")),
         Cell("gpt2", "finetune", 512, 64, 128),
         *(Cell("pythia-1b", f"distill:{loss}", 2048, 128, 64) for loss in ("softmax", "l2", "direct")),
         Cell("pythia-1b", "finetune", 512, 128, 128)]


@dataclass
class CheckResult:
    teacher: str
    stage: str
    precision: str
    seq_len: int
    batch: int
    micro_batch: int | None
    tokens_per_s: float
    step_s: float
    projected_cell_hours: float  # distillation: one pass of the paper's tokens; finetune: one cell's student
    measured_peak_bytes: int | None
    measured_kind: str  # cuda (allocated on the GPU) | rss (the CPU block's peak resident set) | rss_process
    predicted_peak_bytes: int | None
    host_syncs_per_step: int | None
    problem: str | None = None


def config_of(teacher: str, tiny: bool):
    """The teacher's transformers configuration: the real shapes, or tiny ones (2 layers, width 64)."""
    if teacher == "gpt2":
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256, bos_token_id=0,
                          eos_token_id=0) if tiny else GPT2Config()
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 vocab_size=256, max_position_embeddings=256) if tiny else \
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192, vocab_size=50304,
             max_position_embeddings=2048)
    return GPTNeoXConfig(**shape, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)


def shrunk(cell: Cell) -> Cell:
    """The cell at tiny sizes: 64 tokens, 16 features, 4 sequences."""
    return replace(cell, seq_len=64, budget=16, batch=4)


def device_precisions(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["fp32", "tf32", *(["bf16"] if torch.cuda.is_bf16_supported() else [])]
    return ["fp32", "bf16"]  # tf32 is a CUDA matmul mode: on the CPU it is fp32


class HostSyncs(TorchFunctionMode):
    """Counts the tensor calls made from dofla's code that read a value on the host (on a GPU: only
    those reading a GPU tensor; on the CPU every such read counts, the proxy the unit tests use), the
    probe harness (:mod:`dofla.train.probe_steps`) left out."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.count, self.root = device, 0, str(Path(dofla.__file__).parent)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == self.device.type:
            caller = traceback.extract_stack(limit=2)[0]  # the probe's own harness is not the step's code
            if caller.filename.startswith(self.root) and not caller.filename.endswith("probe_steps.py"):
                self.count += 1
        return func(*args, **(kwargs or {}))


def builders(cell: Cell, precision: str, device: torch.device, teacher):
    """(the cell's step builder, a callable that predicts its :class:`~dofla.train.capacity.Peak`: the
    memory preflight's trace, on the CPU)."""
    n, heads = teacher.config.num_hidden_layers, teacher.config.num_attention_heads
    head_dim = teacher.config.hidden_size // heads
    maps = [build_layer_feature_map("learned_prf", heads, head_dim, cell.budget, seed=i) for i in range(n)]
    features = sum(capacity.module_bytes(m) for m in maps)
    loss = cell.stage.removeprefix("distill:")
    cfg = LayerTrainConfig(loss="softmax" if loss in ("direct", "finetune") else loss, batch_size=cell.batch,
                           micro_batch_size=1, precision=precision)
    if cell.stage == "finetune":
        step = probe_steps.task_step(lambda cut: cut, teacher, cell.seq_len, precision, steps=1, device=device)
        return step, lambda: capacity.task_step_peak([lambda cut: cut], teacher, n, cell.seq_len, precision,
                                                     2 * capacity.module_bytes(teacher), 1, cell.batch)

    def student_of(cut):
        return convert(cut, feature_map="learned_prf", dims=[cell.budget] * cut.config.num_hidden_layers)

    if loss == "direct":
        step = probe_steps.direct_step(student_of, teacher, cfg, cell.seq_len, steps=1, device=device)
        return step, lambda: capacity.direct_step_peak(student_of, teacher, n, cfg, cell.seq_len,
                                                       2 * capacity.module_bytes(teacher) + features)
    dtype = getattr(torch, teacher_dtype(precision, "float32"))
    step = probe_steps.stream_step(teacher, maps, list(range(n)), cfg, cell.seq_len, dtype, steps=1, device=device)
    return step, lambda: capacity.stream_step_peak(teacher, maps, list(range(n)), cfg, cell.seq_len,
                                                   capacity.copy_bytes(teacher, dtype), dtype)


def finetune_tokens(seq_len: int) -> float:
    """Tokens of one model's task fine-tunes on the seven tasks, every row at ``seq_len`` (a bound)."""
    return sum(n * EPOCHS[task] * seq_len for task, n in TRAIN_EXAMPLES.items())


def check_cell(cell: Cell, precision: str, device: torch.device, tiny: bool, tolerance: float,
               limit: int | None = None) -> CheckResult:
    """Predict the cell's peak, pick the micro-batch ``auto`` would, run one step at it (after a warm-up),
    time it, measure its peak and count its host synchronisations."""
    cell = shrunk(cell) if tiny else cell
    result = CheckResult(cell.teacher, cell.stage, precision, cell.seq_len, cell.batch, None, 0.0, math.nan,
                         math.nan, None, "cuda" if device.type == "cuda" else "rss", None, None)
    configure_matmul(precision)
    try:
        with torch.device("meta"):
            teacher = AutoModelForCausalLM.from_config(config_of(cell.teacher, tiny))
        step, predict = builders(cell, precision, device, teacher)
        twin = (cell, "fp32" if precision == "tf32" else precision)  # tf32 changes no tensor: fp32's memory
        peak = PEAKS[twin] = PEAKS[twin] if twin in PEAKS else predict()
        micro = capacity.largest_fitting(peak, cell.batch, limit or capacity.device_memory(device))
        if micro is None:
            result.problem = f"does not fit even at micro-batch 1 (≈ {peak.at(1).bytes / 2**30:.1f} GiB predicted)"
            return result
        result.micro_batch, result.predicted_peak_bytes = micro, peak.at(micro).bytes
        result = measured(result, step, teacher.config.num_hidden_layers, micro, device, peak_memory)
    except Exception as err:  # noqa: BLE001 - every failure is reported, in one sentence
        result.problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        configure_matmul("fp32")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = PAPER_TOKENS if cell.stage.startswith("distill") else finetune_tokens(cell.seq_len)
    if result.tokens_per_s > 0:
        result.projected_cell_hours = tokens / result.tokens_per_s / 3600
    if result.problem is None and device.type == "cuda" and result.measured_peak_bytes is not None \
            and result.measured_peak_bytes > (1 + tolerance) * result.predicted_peak_bytes:
        result.problem = (f"the measured peak {result.measured_peak_bytes / 2**30:.2f} GiB exceeds the preflight's "
                          f"{result.predicted_peak_bytes / 2**30:.2f} GiB by more than {tolerance:.0%}: "
                          "micro_batch_size=auto may run out of memory here")
    return result


def measured(result: CheckResult, step, layers: int, micro: int, device: torch.device, peak_memory) -> CheckResult:
    """``result`` with one whole-depth step's time, peak memory and host synchronisations."""
    with quiet(), peak_memory(device) as peak:
        run = step(layers, micro)
        out = run()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    with quiet(), HostSyncs(device) as syncs:
        run()
    if isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
        result.problem = "the step's loss is not finite"
    result.step_s, result.tokens_per_s = seconds, micro * result.seq_len / seconds
    result.measured_peak_bytes, result.measured_kind = peak["bytes"], peak["kind"]
    result.host_syncs_per_step = syncs.count
    return result


def sweep_hours(checks: list[dict]) -> dict:
    """{teacher: {precision: hours}} of a paper sweep on this device: each cell's distillation, each
    cell's student fine-tunes, the teacher's grid once (``GRID`` rates), from the measured rates."""
    out: dict = collections.defaultdict(dict)
    by = {(c["teacher"], c["stage"], c["precision"]): c["projected_cell_hours"] for c in checks}
    for teacher, counts in SWEEPS.items():
        for precision in sorted({c["precision"] for c in checks if c["teacher"] == teacher}):
            tune = by.get((teacher, "finetune", precision), math.nan)
            train = sum(n * by.get((teacher, f"distill:{loss}", precision), math.nan)
                        for loss, n in counts.items() if loss != "cells")
            out[teacher][precision] = train + (counts["cells"] + GRID) * tune
    return dict(out)


def run_gpu_tests(timeout: int = 600) -> dict:
    """``pytest -m gpu`` on the test files that hold gpu-marked tests (a checkout only)."""
    root = Path(dofla.__file__).resolve().parents[2]
    files = sorted(str(p) for p in (root / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    if not files:
        return {"ran": False, "returncode": None,
                "summary": "no tests beside this installation (a wheel); run pytest -m gpu in a checkout"}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files],
                              cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": True, "returncode": -1, "summary": f"the gpu tests ran past {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    code = 0 if done.returncode == 5 else done.returncode  # 5: none collected
    return {"ran": True, "returncode": code, "files": len(files), "summary": lines[-1] if lines else done.stderr[-300:]}
