"""benchmarks/counting.py: ops kept for replay, in-place ops replayed on copies, and the kernel's
time breakdown row built from them."""
import torch

from benchmarks.bench_attention import breakdown_row, inputs, python
from benchmarks.counting import StepCounter, replay


def test_kept_ops_replay_without_touching_the_tensors_they_ran_on():
    a, b = torch.ones(4, 4), torch.full((4, 4), 2.0)
    with StepCounter(keep=True) as counter:
        c = a @ b
        a.add_(1)
    assert torch.equal(a, torch.full((4, 4), 2.0))
    assert [op.flops for op in counter.ops] == [2 * 4 * 4 * 4, 0]
    for _ in range(3):
        assert replay(counter.ops, repeats=2) > 0
    assert torch.equal(a, torch.full((4, 4), 2.0))  # the in-place add ran on copies of a
    func, args, kwargs, in_place = counter.ops[1].call
    assert in_place and torch.equal(args[0], torch.ones(4, 4))  # a copy of a as the add found it
    assert torch.equal(c, torch.full((4, 4), 8.0))


def test_ops_are_not_kept_unless_asked():
    with StepCounter() as counter:
        torch.ones(3).exp()
    assert all(op.call is None for op in counter.ops)


def test_the_breakdown_row_splits_the_kernel_into_matmuls_other_ops_and_python():
    q, k, v, fm = inputs(512)
    with torch.no_grad():
        row = breakdown_row(fm.log_features(q), fm.log_features(k), v, 512, reps=1, gflops=100.0)
    assert row.ratio > 0 and row.ok is None
    assert "matmuls" in row.measured and "other ops" in row.measured and "Python between them" in row.measured
    assert python(0.002) == "Python between them 2 ms" and python(-0.003).startswith("no time left for Python")
