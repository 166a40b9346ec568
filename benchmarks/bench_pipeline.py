"""The pipeline's own costs: Algorithm 1, layerwise vs direct training, activation cache build.

    python -m benchmarks.bench_pipeline [--quick]
"""
from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time

import torch

from benchmarks.common import Row, print_rows, save_rows, timeit
from dofla.cache import build_or_load_cache, predict_cache_bytes
from dofla.dof import dof_dense_reference, estimate_layer_dof, gram_matrix, sample_pool
from dofla.models import EMBEDDED, convert, get_adapter, load_teacher
from dofla.train import LayerTrainConfig
from dofla.train.layerwise import layer_loss


def bench_dof(layers: int = 12, heads: int = 12, j: int = 2048) -> Row:
    """Algorithm 1 for a GPT-2-sized model (12 × 12 heads, J=2048) vs the paper's 105 s (A100)."""
    g = torch.Generator().manual_seed(0)
    acts = [(torch.randn(j, heads, 64, generator=g) * 1.3, torch.randn(j, heads, 64, generator=g) * 1.3)
            for _ in range(layers)]
    start = time.perf_counter()
    values = [estimate_layer_dof(q, k, 1e-2, j, "trace", seed=i)[0] for i, (q, k) in enumerate(acts)]
    seconds = time.perf_counter() - start
    q, k = acts[0]
    x = sample_pool(q, k, 0, j, torch.Generator().manual_seed(0))
    dense = dof_dense_reference(gram_matrix(x, "trace"), 1e-2)
    same = math.isclose(dense, values[0][0], rel_tol=1e-8)
    return Row(f"Algorithm 1, {layers} layers × {heads} heads, J={j}", "paper: 105 s on an A100", "≤ 60 s",
               f"{seconds:.1f} s; head 0 DoF {values[0][0]:.3f} vs dense {dense:.3f}", seconds / 60,
               seconds <= 60 and same)


def bench_training(teacher, seq_len: int = 512) -> Row:
    """Per training sample: all 30 layers' layerwise losses (from cached q/k) vs one direct step."""
    g = get_adapter(teacher).geometry(teacher.config)
    ids = torch.randint(0, 1000, (1, seq_len))
    from dofla.models import capture_qkv

    layers = capture_qkv(teacher, ids)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[64] * g.num_layers)
    maps = [a.feature_map for a in student.student_attentions()]
    cfg = LayerTrainConfig()

    def layerwise():
        for fm, (q, k, _) in zip(maps, layers):
            layer_loss(fm, q, k, cfg).backward()

    def direct():
        for p in student.parameters():
            p.requires_grad_(False)
        for fm in maps:
            fm.requires_grad_(True)
        student(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    t_layer, t_direct = timeit(layerwise, repeats=2), timeit(direct, repeats=2)
    return Row(f"training cost per sample (L={seq_len}, 30 layers)", "direct (end to end)", "≤ 1/5",
               f"layerwise {t_layer:.2f} s vs direct {t_direct:.2f} s", t_layer / t_direct,
               t_layer / t_direct <= 0.2)


def bench_cache(teacher, num_seqs: int = 8, seq_len: int = 512) -> Row:
    tokens = torch.randint(0, 1000, (num_seqs, seq_len))
    g = get_adapter(teacher).geometry(teacher.config)

    def plain():
        with torch.no_grad():
            for row in tokens.split(4):
                teacher(input_ids=row, use_cache=False)

    t_plain = timeit(plain, repeats=1)
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        cache = build_or_load_cache(teacher, tokens, {"bench": time.time()}, root, batch_size=4, progress=False)
        t_cache = time.perf_counter() - start
        data = sum(p.stat().st_size - 128 for p in cache.path.glob("*.npy"))
    predicted = predict_cache_bytes(g, num_seqs, seq_len)
    return Row(f"activation cache build ({num_seqs}×{seq_len} tokens)", "plain teacher forward", "≤ 1.3×",
               f"{t_cache:.1f} s vs {t_plain:.1f} s; disk {data / 2**20:.1f} MiB = predicted "
               f"{predicted / 2**20:.1f} MiB", t_cache / t_plain, t_cache / t_plain <= 1.3 and data == predicted)


def main(quick: bool = False) -> list[Row]:
    teacher, _ = load_teacher(EMBEDDED)
    rows = [bench_dof(j=512 if quick else 2048)]
    rows.append(bench_training(teacher, 128 if quick else 512))
    rows.append(bench_cache(teacher, 2 if quick else 8, 128 if quick else 512))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = main(args.quick)
    save_rows("pipeline", rows)
    print_rows(rows)
