"""The cost model (studies/cost_model.py): its op counter against torch's FLOP counter, the depth
extrapolation against a deeper cut counted directly, the precision's dtypes, the GPU arithmetic."""
from dataclasses import dataclass

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from dofla.models.tiny import TINY_FAMILIES, TINY_VOCAB
from dofla.train import capacity
from benchmarks.counting import Op, StepCounter
from studies.cost_model import cell_cost, main, steps_of
from studies.cost_ops import Gpu, counted, seconds
from studies.paper_memory import Teacher


@dataclass
class TinyTeacher(Teacher):
    arch: str = "llama"

    def config(self):
        _, config = TINY_FAMILIES[self.arch](4)
        config.vocab_size = TINY_VOCAB
        return config


TINY = TinyTeacher("tiny", seq_len=96, budget=8, batch=4, micro=2)


def ops_at(teacher: Teacher, loss: str, precision: str, depth: int) -> list[Op]:
    step = steps_of(teacher, loss, precision)[0]
    torch.manual_seed(0)  # the same random batch and features for every count of a cell
    return counted(step(depth, 1))


def flops(ops: list[Op], kind: str | None = None) -> int:
    return sum(op.flops for op in ops if kind is None or op.kind == kind)


def test_the_counter_files_flops_under_the_dtype_they_run_in_and_skips_views():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with StepCounter() as plain:
        (a @ b).t().exp()
    assert [(op.kind, op.flops, op.written) for op in plain.ops] == [("float32", 2 * 8 * 16 * 4, 32 * 4), ("", 0, 32 * 4)]
    with StepCounter() as mixed, torch.autocast("cpu", dtype=torch.bfloat16):
        a @ b
    assert [(op.kind, op.flops) for op in mixed.ops if op.flops] == [("bfloat16", 2 * 8 * 16 * 4)]
    assert [op.written for op in mixed.ops if op.flops] == [32 * 2]  # a bfloat16 output


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("loss", ["softmax", "direct"])
def test_its_flops_equal_torchs_flop_counter_on_the_real_step(arch, loss):
    teacher = TinyTeacher("tiny", 96, 8, 4, 2, arch)
    step = steps_of(teacher, loss, "fp32")[0]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(step(2, 1))
    reference = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v)})
    with capacity.quiet(), reference:
        runs[0]()
    ours = counted(runs[1])
    assert flops(ours) == reference.get_total_flops() > 0


@pytest.mark.parametrize("loss", ["softmax", "l2", "direct"])
def test_counts_are_affine_in_depth_so_two_cuts_predict_a_third(loss):
    one, two, three = (ops_at(TINY, loss, "fp32", n) for n in (1, 2, 3))
    assert capacity.in_depth(flops(one), flops(two), 3) == pytest.approx(flops(three), rel=1e-6)
    written = [sum(op.written for op in ops) for ops in (one, two, three)]
    assert capacity.in_depth(written[0], written[1], 3) == pytest.approx(written[2], rel=0.01)


def test_the_precision_decides_the_dtypes_and_l2_moves_the_most_bytes():
    fp32, bf16, l2 = ops_at(TINY, "softmax", "fp32", 1), ops_at(TINY, "softmax", "bf16", 1), ops_at(TINY, "l2", "fp32", 1)
    assert flops(fp32, "float32") == flops(fp32) > 0
    assert flops(bf16, "bfloat16") > 0.9 * flops(bf16)  # the teacher's bfloat16 copy and the autocast loss
    assert flops(bf16) == pytest.approx(flops(fp32), rel=0.01)  # the same arithmetic, cheaper numbers
    assert sum(op.written for op in l2) > 2 * sum(op.written for op in fp32)  # its float64 (L, L) terms


def test_gpu_seconds_charge_matmuls_at_their_dtypes_peak_and_other_ops_their_traffic():
    gpu = Gpu("toy", 10**9, bandwidth=1e9, peaks={"float64": 1e9, "float32": 2e9, "tf32": 8e9, "bfloat16": 16e9})
    ops = [Op("float32", 8e9, 10**8), Op("bfloat16", 16e9, 10**6), Op("", 0, 10**9)]
    s = seconds(ops, gpu, "fp32")
    assert (s.matmul, s.traffic) == (pytest.approx(4 + 1), pytest.approx(2.0))
    assert s.floor == pytest.approx(max(4, 0.2) + max(1, 0.002) + 2)
    assert s.predicted(0.5) == pytest.approx(5 / 0.5 + 2)
    assert seconds(ops, gpu, "tf32").matmul == pytest.approx(1 + 1)  # float32 matmuls on TensorFloat-32


def test_a_cell_costs_positive_hours_and_fits_a_big_gpu_at_its_whole_batch():
    cost = cell_cost(TINY, "softmax", "bf16")
    assert set(cost.flops) >= {"bfloat16"} and cost.written > 0
    for s in cost.per_gpu.values():
        assert 0 < s.floor and 0 < s.predicted(0.4)
    assert cost.peak.bytes > 0 and set(cost.fits.values()) == {TINY.batch}


def test_bad_arguments_are_refused_before_any_counting(capsys):
    with pytest.raises(SystemExit):
        main(["--losses", "cosine"])
    assert "--losses from softmax,l2,direct" in capsys.readouterr().err


def test_the_disk_table_counts_fp16_q_k_v_of_every_layer():
    from studies.cost_model import disk_table
    from studies.paper_memory import TEACHERS

    gpt2 = disk_table(TEACHERS[:1], 1e6).splitlines()[2]
    assert "| gpt2 | 55.3 KB | 0.1 TB | 0.45 GB |" == gpt2  # 12 layers × (12 + 2 × 12) heads × 64 × 2 bytes


def test_the_cpu_check_times_the_step_it_predicts():
    from studies.cost_model import CALIBRATION_HEAD, calibration

    row = calibration("softmax", TINY, repeats=1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(CALIBRATION_HEAD.splitlines()[0].strip("|").split("|"))
    assert cells[0].startswith("tiny, 2 layers, L = 96, M = 8, softmax") and float(cells[-1]) > 0
