"""The evaluation protocol's share in the cost model (studies/cost_sweep.py): the task fine-tune step is
counted for teacher and student, and a sweep is every cell's distillation and student fine-tunes plus
the teacher's grid once."""
import pytest

from studies.cost_model import cell_cost
from studies.cost_ops import GPUS
from studies.cost_sweep import EVAL_TOKENS, GRID, eval_costs, sweep_parts, sweep_table

from tests.unit.test_cost_model import TinyTeacher

GPT2_SHAPED = TinyTeacher("gpt2", seq_len=96, budget=8, batch=4, micro=2, arch="gpt2")  # the sweep's name, tiny


@pytest.fixture(scope="module")
def costs():
    distill = [cell_cost(GPT2_SHAPED, loss, "fp32", memory=False) for loss in ("softmax", "l2", "direct")]
    return distill + eval_costs(GPT2_SHAPED, "fp32", memory=False)


def test_the_fine_tune_of_teacher_and_student_is_counted_per_token(costs):
    teacher, student = costs[-2:]
    assert (teacher.loss, student.loss) == ("finetune:teacher", "finetune:student")
    assert teacher.flops["float32"] > 0 and student.flops["float32"] > 0
    # every parameter trains: the fine-tune's matmuls (forward and backward of the whole model, the LM
    # head included) outweigh the distillation's streamed step (teacher forward, features' backward)
    assert teacher.flops["float32"] > costs[0].flops["float32"]
    assert EVAL_TOKENS == 512 * (3 * (16_113 + 7_376 + 2_251 + 1_119 + 40_398 + 554) + 99_842)


def test_a_sweep_is_every_cells_distillation_and_fine_tune_and_one_grid(costs):
    gpu = GPUS[0].name
    train, students, grid = sweep_parts(costs, "gpt2", "fp32", gpu, 0.4)
    by = {c.loss: c.per_gpu[gpu].predicted(0.4) for c in costs}
    assert train == pytest.approx(3 * (by["softmax"] + by["l2"] + by["direct"]) * 362e6 / 3600)
    assert students == pytest.approx(11 * by["finetune:student"] * EVAL_TOKENS / 3600)
    assert grid == pytest.approx(GRID * by["finetune:teacher"] * EVAL_TOKENS / 3600)
    assert sweep_parts(costs, "gpt2", "tf32", gpu, 0.4) is None  # not counted: no row
    table = sweep_table(costs, 0.4)
    assert table.count("| gpt2 | 11 | fp32 |") == len(GPUS) and "pythia-1b" not in table
