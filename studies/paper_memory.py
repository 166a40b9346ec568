"""Peak memory of the paper's training cells, predicted by the memory preflight's trace.

``python -m studies.paper_memory --out studies/results/paper_memory.md``

For GPT-2 (L = 1024, C = 64, batch 128) and Pythia-1B (L = 2048, C = 128, batch 64), each built from
its configuration (weights on the meta device: nothing is downloaded), it predicts the train
stage's peak for the streamed layerwise losses (softmax, l2) and for ``direct``, at the whole
batch, at the experiment's micro-batch and at micro-batch 1, in fp32: the trace runs the real step
of 1- and 2-layer cuts on this CPU (:mod:`dofla.train.capacity`). Other precisions are traced by
``studies.cost_model`` (bf16 is not always smaller: the losses keep float32 terms). Every layer gets the
budget's dim (``fix``); ``dof`` moves individual layers, not the per-layer peak of the widest one
by much at these budgets. ``--losses finetune`` adds the evaluation protocol's task fine-tune (every
parameter of the teacher, AdamW, MMLU's batch of 128 rows of 512 tokens, the student and the working
copy loaded beside the teacher). It prints markdown; ``--out`` writes it with the command on top.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dofla.feature_maps import build_layer_feature_map
from dofla.models import convert
from dofla.train import LayerTrainConfig, capacity

GIB = 2**30


@dataclass
class Teacher:
    name: str
    seq_len: int
    budget: int
    batch: int
    micro: int

    def config(self):
        from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

        if self.name == "gpt2":
            return GPT2Config()  # GPT-2 small: 12 layers, 12 heads of 64, vocab 50,257
        if self.name == "smollm2-135m":  # the embedded model's shapes (the cost model's CPU check)
            return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                               num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True,
                               max_position_embeddings=8192)
        return GPTNeoXConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192,
                             vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048,
                             use_parallel_residual=True, tie_word_embeddings=False)  # Pythia-1B


TEACHERS = [Teacher("gpt2", 1024, 64, 128, 16), Teacher("pythia-1b", 2048, 128, 64, 8)]


def on_meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def finetune_cell(t: Teacher) -> Teacher:
    """The evaluation protocol's task fine-tune of ``t``: MMLU's batch of 128 rows of 512 tokens."""
    return replace(t, seq_len=512, batch=128, micro=16)


def cell_peaks(t: Teacher, loss: str) -> tuple[capacity.Peak, float]:
    teacher = on_meta(t.config())
    if loss == "finetune":  # every parameter of the teacher, AdamW; teacher, student and the working copy loaded
        start = time.perf_counter()
        peak = capacity.task_step_peak([lambda cut: cut], teacher, teacher.config.num_hidden_layers, t.seq_len, "fp32",
                                       3 * capacity.module_bytes(teacher), 1, t.batch)
        return peak, time.perf_counter() - start
    layers, heads = teacher.config.num_hidden_layers, teacher.config.num_attention_heads
    head_dim = teacher.config.hidden_size // heads
    maps = [build_layer_feature_map("learned_prf", heads, head_dim, t.budget, seed=i) for i in range(layers)]
    cfg = LayerTrainConfig(loss="softmax" if loss == "direct" else loss, batch_size=t.batch)
    start = time.perf_counter()
    if loss == "direct":
        def student_of(cut):
            return convert(cut, feature_map="learned_prf", dims=[t.budget] * cut.config.num_hidden_layers)

        features = sum(capacity.module_bytes(m) for m in maps)
        peak = capacity.direct_step_peak(student_of, teacher, layers, cfg, t.seq_len,
                                         2 * capacity.module_bytes(teacher) + features)
    else:
        peak = capacity.stream_step_peak(teacher, maps, list(range(layers)), cfg, t.seq_len)
    return peak, time.perf_counter() - start


def table(rows: list[tuple[Teacher, str, capacity.Peak, float]]) -> str:
    lines = ["| teacher | L | C | loss | batch | peak at the whole batch | at micro-batch (experiment) | at micro-batch 1 "
             "| weights + state | per sequence | trace time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, loss, peak, seconds in rows:
        lines.append(f"| {t.name} | {t.seq_len} | {t.budget} | {loss} | {t.batch} | {peak.at(t.batch).bytes / GIB:.1f} GiB "
                     f"| {peak.at(t.micro).bytes / GIB:.1f} GiB ({t.micro}) | {peak.at(1).bytes / GIB:.2f} GiB "
                     f"| {peak.fixed / GIB:.2f} GiB | {peak.per_sample / GIB:.3f} GiB | {seconds:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", default="softmax,l2,direct,finetune")
    parser.add_argument("--teachers", default="gpt2,pythia-1b")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for t in TEACHERS:
        if t.name not in args.teachers.split(","):
            continue
        for loss in args.losses.split(","):
            t = finetune_cell(t) if loss == "finetune" else next(c for c in TEACHERS if c.name == t.name)
            peak, seconds = cell_peaks(t, loss)
            rows.append((t, loss, peak, seconds))
            print(f"{t.name} {loss}: {peak.at(t.batch).bytes / GIB:.1f} GiB at batch {t.batch} ({seconds:.0f} s)", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text("# Predicted peak memory of the paper's training cells (fp32)\n\n"
                            f"`python -m studies.paper_memory --out {args.out}`\n\n" + text + "\n")


if __name__ == "__main__":
    main()
