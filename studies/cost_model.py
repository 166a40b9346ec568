"""What distilling at the paper's scale costs: counted FLOPs per token → GPU days, and disk.

A ``train.source=stream`` step is one teacher forward without gradients (stopped at the deepest
layer's capture) plus, for every layer, its feature-map forward, ``layer_loss`` (default softmax:
(L, L) attention per head), backward and Adam step. FLOPs are counted with
``torch.utils.flop_counter.FlopCounterMode`` on the real code: the teacher from its config under
``FakeTensorMode`` (shapes only, nothing computed), one layer's loss step really run on CPU on one
head of random q, k (heads are independent, so × H). Beside each count is a plain analytic
reference. Predicted time = FLOPs / (peak × MFU); a calibration row turns this CPU's measured
streaming rate into the FLOP/s it achieved.

    python -m studies.cost_model [--tokens 362e6] [--mfu 0.4 0.25] [--measured-tps 285] [--out PATH]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig

from benchmarks.common import Row, markdown, matmul_gflops, set_threads
from dofla.feature_maps import build_layer_feature_map
from dofla.models import get_adapter
from dofla.train import LayerTrainConfig, layer_loss, teacher_qk

PAPER_TOKENS = 362e6  # 10 % of English Wikipedia, one epoch (the paper's GPT-2 run)
GPUS = {"A100": 312e12, "H100 SXM": 989e12}  # bf16 dense peak FLOP/s
FP32_PEAK = {"A100": 19.5e12, "H100 SXM": 67e12}  # plain fp32 (no TF32): how dofla loads teachers today
BANDWIDTH = {"A100": 2.0e12, "H100 SXM": 3.35e12}  # HBM bytes/s (A100 40 GB SXM, H100 SXM)
CACHE_TOKENS = 8192  # data.cache_tokens default when training streams (dofla.stages.data)
DAY = 86400.0


def sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """FlopCounterMode has no formula for CPU's fused SDPA: QKᵀ and PV over the full (L, L)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_flops})


class ElementCounter(TorchDispatchMode):
    """Elements written by every op that is neither a matmul-like op (FlopCounterMode counts
    those) nor a view: the elementwise work (exp, log, softmax, masks) FLOP counts leave out."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in flop_registry and not func.is_view:
            self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def teacher_config(name: str):
    """Random-init configs: GPT-2 small, Pythia-1B, and SmolLM2-135M (the numbers of the embedded
    model's converted config.json). Nothing is downloaded."""
    if name == "gpt2":
        return GPT2Config()
    if name == "pythia-1b":
        return GPTNeoXConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8,
                             intermediate_size=8192, vocab_size=50304, rotary_pct=0.25,
                             max_position_embeddings=2048)
    if name == "smollm2-135m":
        return LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                           max_position_embeddings=8192)
    raise ValueError(f"unknown model {name!r}; choose gpt2, pythia-1b or smollm2-135m")


def fake_model(config):
    """(model, fake mode): the teacher with fake weights (shapes only, no memory, no compute)."""
    config._attn_implementation = "sdpa"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = AutoModelForCausalLM.from_config(config).eval()
    return model, mode


def teacher_flops(model, mode, seq_len: int, stream: bool = True) -> int:
    """Counted FLOPs of one (1, seq_len) teacher forward without gradients: the streaming step's
    ``teacher_qk`` over every layer (stops at the last layer's capture), or the full forward."""
    with mode, torch.no_grad():
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        with flop_counter() as counter:
            if stream:
                layers = list(range(get_adapter(model).geometry(model.config).num_layers))
                teacher_qk(model, get_adapter(model).attention_modules(model), ids, layers)
            else:
                model(input_ids=ids, use_cache=False)
    return counter.get_total_flops()


def linear_params(model) -> int:
    """Weights of every matrix inside the decoder layers (embeddings and the LM head excluded)."""
    n = get_adapter(model).geometry(model.config).num_layers
    stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n)
    return sum(p.numel() for p in stack.parameters() if p.dim() == 2)


def teacher_flops_reference(model, seq_len: int) -> int:
    """Full forward per sequence: 2·(layer matrices) + 2·V·D (LM head) per token, plus QKᵀ and PV
    over the full (L, L) per layer: 4·L·H·d per token."""
    g = get_adapter(model).geometry(model.config)
    lm_head = model.get_output_embeddings().weight
    per_token = 2 * linear_params(model) + 2 * lm_head.numel() + 4 * seq_len * g.num_heads * g.head_dim * g.num_layers
    return per_token * seq_len


@dataclass
class LossCount:
    flops: int  # one (1, H, L, d) layer step: features, loss, backward (× H from one head)
    elements: int  # written by elementwise ops in that step (× H)


def layer_step_count(num_heads: int, head_dim: int, features: int, seq_len: int, seed: int = 0) -> LossCount:
    """Counts of one layer's training step at batch 1: learned PRF features of q and k, the real
    ``layer_loss`` (softmax), backward. Run on one head of random q, k (N(0, 1): the fast
    stabiliser path; real activations may add exact rows), then × ``num_heads``."""
    fmap = build_layer_feature_map("learned_prf", 1, head_dim, features, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 1, seq_len, head_dim, generator=gen) for _ in range(2))
    elements = ElementCounter()
    with flop_counter() as counter, elements:
        layer_loss(fmap, q, k, LayerTrainConfig()).backward()
    return LossCount(counter.get_total_flops() * num_heads, elements.elements * num_heads)


def layer_step_reference(num_heads: int, head_dim: int, features: int, seq_len: int, block: int = 128) -> int:
    """Per sequence: teacher logits 2·L²·d (no gradient); features 2·2·L·d·M forward and as much
    backward (only z has a gradient); student kernel over causal key blocks of 128, P pairs,
    2·P·M forward and 4·P·M backward. × H heads."""
    pairs = sum((seq_len - start) * min(block, seq_len - start) for start in range(0, seq_len, block))
    per_head = 2 * seq_len**2 * head_dim + 8 * seq_len * head_dim * features + 6 * pairs * features
    return per_head * num_heads


@dataclass
class StepCost:
    """Per-token costs of one streaming step (FLOPs; elements; bytes)."""

    name: str
    seq_len: int
    features: int
    layers: int
    teacher: float  # counted: the streaming teacher forward (teacher_qk)
    teacher_full: float  # counted: the full forward, LM head included
    teacher_reference: float  # analytic, full forward
    loss: float  # counted: every layer's training step
    loss_reference: float  # analytic, every layer
    elements: float  # elementwise outputs of every layer's step
    cache_bytes: int  # fp16 q, k, v of every layer

    @property
    def total(self) -> float:
        return self.teacher + self.loss


def step_cost(name: str, seq_len: int, features: int | None = None) -> StepCost:
    """Per-token costs of ``name`` at context ``seq_len``; M = head_dim (budget=head_dim) unless given."""
    model, mode = fake_model(teacher_config(name))
    g = get_adapter(model).geometry(model.config)
    m = features or g.head_dim
    step = layer_step_count(g.num_heads, g.head_dim, m, seq_len)
    per_layer = g.num_layers / seq_len
    return StepCost(
        name, seq_len, m, g.num_layers,
        teacher=teacher_flops(model, mode, seq_len) / seq_len,
        teacher_full=teacher_flops(model, mode, seq_len, stream=False) / seq_len,
        teacher_reference=teacher_flops_reference(model, seq_len) / seq_len,
        loss=step.flops * per_layer,
        loss_reference=layer_step_reference(g.num_heads, g.head_dim, m, seq_len) * per_layer,
        elements=step.elements * per_layer,
        cache_bytes=g.num_layers * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * 2)


def fmt_time(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds < DAY else f"{seconds / DAY:.2f} d"


def fmt_bytes(n: float) -> str:
    units = ["B", "KB", "MB", "GB", "TB", "PB"]
    power = min(len(units) - 1, int(math.log10(max(n, 1)) // 3))
    return f"{n / 1000**power:.1f} {units[power]}"


def flops_table(costs: list[StepCost]) -> str:
    """Per-token FLOPs: counted beside the analytic reference."""
    lines = ["| teacher | L | M | teacher stream fwd | teacher full fwd (counted / analytic) | all layers' loss steps "
             "(counted / analytic) | step total | elementwise outputs (elements) | cache q,k,v (fp16, bytes) |", "|" + "---|" * 9]
    for c in costs:
        lines.append(
            f"| {c.name} | {c.seq_len} | {c.features} | {c.teacher / 1e6:.1f} M | {c.teacher_full / 1e6:.1f} M / "
            f"{c.teacher_reference / 1e6:.1f} M | {c.loss / 1e6:.1f} M / {c.loss_reference / 1e6:.1f} M | "
            f"{c.total / 1e6:.1f} M | {c.elements / 1e6:.2f} M | {c.cache_bytes / 1e3:.1f} KB |")
    return "\n".join(lines)


def time_rows(cost: StepCost, tokens: float, paper_days: float, mfus: list[float]) -> list[Row]:
    """Predicted wall time per GPU and MFU, against the paper's reported time."""
    rows = []
    for gpu, peak in GPUS.items():
        floor = cost.elements * tokens * 8 / BANDWIDTH[gpu]  # fp32, each element written once, read once
        for mfu in mfus:
            seconds = cost.total * tokens / (peak * mfu)
            ratio = seconds / (paper_days * DAY)
            rows.append(Row(
                f"{cost.name} stream, {tokens / 1e6:.0f}M tok, L={cost.seq_len}, M={cost.features}: {gpu} @ {mfu:.0%} MFU",
                f"paper: {paper_days:g} day", f"{paper_days * 24:g} h", fmt_time(seconds), ratio, None,
                f"{cost.total * tokens:.2e} FLOP; all-fp32 as loaded today "
                f"{fmt_time(cost.total * tokens / (FP32_PEAK[gpu] * mfu))}; elementwise traffic floor {fmt_time(floor)}"))
    return rows


def disk_row(cost: StepCost, tokens: float) -> Row:
    everything, bounded = cost.cache_bytes * tokens, cost.cache_bytes * CACHE_TOKENS
    return Row(f"{cost.name} disk: train.source=cache of all {tokens / 1e6:.0f}M tokens",
               f"train.source=stream, bounded cache of {CACHE_TOKENS} tokens", "", f"{fmt_bytes(everything)} vs "
               f"{fmt_bytes(bounded)}", everything / bounded, None, f"{cost.cache_bytes} B/token (fp16 q, k, v)")


def calibration_row(cost: StepCost, tokens_per_s: float, threads: int) -> Row:
    """This CPU's achieved FLOP/s in the measured streaming run against its matmul rate now."""
    achieved = cost.total * tokens_per_s
    peak = matmul_gflops(1024) * 1e9 * threads
    return Row(f"calibration: {cost.name} stream step (L={cost.seq_len}, M={cost.features}) "
               f"{cost.total / 1e6:.0f} MFLOP/token × {tokens_per_s:g} tok/s measured on this CPU",
               f"fp32 1024² matmul rate now, 1 thread × {threads}", f"{peak / 1e9:.0f} GFLOP/s",
               f"{achieved / 1e9:.1f} GFLOP/s", achieved / peak, None,
               "ratio = this CPU's MFU in the real pipeline (the load of other jobs lowers the matmul rate)")


# (teacher, context, paper's wall time in days): the paper's two runs; Pythia also at the
# repo's paper_pythia1b context (data.seq_len=2048)
RUNS = [("gpt2", 1024, 0.5), ("pythia-1b", 1024, 1.0), ("pythia-1b", 2048, 1.0)]

NOTES = """Assumptions:
- FLOPs counted by torch.utils.flop_counter.FlopCounterMode (matmuls and SDPA; QKᵀ and PV over the full
  (L, L), as the counter does; a causal flash kernel does about half). The teacher runs on fake tensors
  (FakeTensorMode: shapes only); one layer's loss step really runs on CPU on one head of N(0, 1) q, k, × H.
- A streaming step = teacher forward without gradients up to the last layer's capture (no LM head, no last
  MLP) + every layer's learned-PRF features, softmax loss, backward (only z, α have gradients; the counter
  counts the backward that autograd runs, about 2× forward for the student kernel, 1× for the features).
  Adam (H·M·(d+1) parameters per layer), held-out evaluations and data loading are neglected.
- Elementwise work (exp, log, softmax, masks over (L, L) per head) has no FLOPs in the counter; its
  column counts the elements those ops write, and the traffic floor takes 8 bytes each (fp32, written
  once, read once) at HBM bandwidth (A100 2.0 TB/s, H100 SXM 3.35 TB/s). It is a floor, not a prediction.
- Time = FLOPs / (bf16 dense peak × MFU): A100 312, H100 SXM 989 TFLOP/s, MFU 40 % and 25 %. This
  assumes a bf16 teacher and bf16/TF32 loss matmuls. Today load_teacher loads fp32 and the loss runs in
  fp32 without TF32, so the note's "all-fp32" time uses the fp32 peaks (A100 19.5, H100 SXM 67 TFLOP/s).
- Feature dim M = head_dim (budget=head_dim): 64 for GPT-2, 256 for Pythia-1B (8 heads of 256).
- Pythia-1B uses the same 362M tokens as GPT-2 (the paper gives ~1 day, not its token count).
- Disk: train.source=cache writes fp16 q, k, v of every layer for every token; streaming caches only
  data.cache_tokens (default 8,192) for the DoF allocation and held-out loss."""


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=PAPER_TOKENS, help="distillation tokens (default 362e6)")
    parser.add_argument("--mfu", type=float, nargs="+", default=[0.4, 0.25], help="model FLOP utilisations")
    parser.add_argument("--measured-tps", type=float, default=285.0,
                        help="train.source=stream tokens/s measured on this CPU (SmolLM2-135M, L=512, M=64)")
    parser.add_argument("--measured-threads", type=int, default=2, help="threads of that measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the counting here")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables as markdown here")
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.measured_tps <= 0 or not all(0 < m <= 1 for m in args.mfu):
        parser.error("--tokens and --measured-tps must be positive and every --mfu in (0, 1]")
    set_threads(args.threads)
    costs = [step_cost(name, seq_len) for name, seq_len, _ in RUNS]
    rows = [r for c, (_, _, days) in zip(costs, RUNS) for r in time_rows(c, args.tokens, days, args.mfu)]
    rows += [disk_row(c, args.tokens) for c in costs[:2]]
    calibration = step_cost("smollm2-135m", 512, features=64)
    rows.append(calibration_row(calibration, args.measured_tps, args.measured_threads))
    report = (f"## Per token: FLOPs (counted / analytic), elementwise outputs, cache bytes\n\n{flops_table(costs + [calibration])}\n\n"
              f"## Predicted wall time, disk, calibration\n\n{markdown(rows)}\n\n{NOTES}\n")
    print(report)
    if args.out is not None:
        args.out.write_text("# Cost model: distillation at the paper's scale\n\n"
                            "`python -m studies.cost_model --out studies/results/cost_model.md`\n\n" + report)
    return rows


if __name__ == "__main__":
    main()
