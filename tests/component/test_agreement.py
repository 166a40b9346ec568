"""Generation-scored agreement on the tiny Llama: ``generate()`` with the decode cache gives the plain
greedy continuation; the exact reference student agrees with its teacher on every token of every
prompt, a linear student less; the eval stage takes it as a registered measurement when asked."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dofla.config import RunConfig
from dofla.errors import DoflaError
from dofla.eval.agreement import (
    agreement_metrics,
    agreement_prompts,
    greedy_continuations,
    greedy_reference,
    matched_prefix,
)
from dofla.eval.store import MEASUREMENTS
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.stages.eval import evaluate

NEW = 32


def teacher():
    """The tiny Llama with its attention weights scaled up: at random initialisation its continuations
    repeat the last token whatever attention does, so no student could disagree."""
    model = build_tiny_model("llama", seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                p.mul_(4)
    return model


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(1))


def test_matched_prefix_counts_leading_agreement():
    a = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    b = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    assert matched_prefix(b, a).tolist() == [3, 1, 0]  # a later agreement after a miss does not count


@pytest.mark.parametrize("student", [None, "elu1"], ids=["teacher", "linear"])
def test_generate_with_the_cache_is_the_plain_greedy_continuation(prompts, student):
    model = teacher() if student is None else convert(teacher(), feature_map=student, dims=[16, 16])
    assert torch.equal(greedy_continuations(model, prompts, NEW, batch_size=4), greedy_reference(model, prompts, NEW))


def test_the_exact_reference_agrees_fully_and_a_linear_student_less(prompts):
    same = agreement_metrics(teacher(), convert(teacher(), feature_map="softmax"), prompts, NEW, batch_size=4)
    assert same["agreement/first_token"] == 1.0 and same["agreement/prefix_len"] == NEW
    assert same["seq/agreement/prefix_len"] == [float(NEW)] * len(prompts)
    other = agreement_metrics(teacher(), convert(teacher(), feature_map="elu1", dims=[16, 16]), prompts, NEW, 4)
    assert other["agreement/prefix_len"] < NEW and other["agreement/first_token"] < 1.0
    assert len(other["seq/agreement/first_token"]) == len(prompts)
    assert other["agreement/prefix_len"] == pytest.approx(sum(other["seq/agreement/prefix_len"]) / len(prompts))


def test_prompts_are_pieces_of_the_held_out_sequences_and_too_many_are_refused():
    heldout = torch.arange(2 * 10).reshape(2, 10)
    assert agreement_prompts(heldout, 3, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13]]
    with pytest.raises(DoflaError, match="eval.agreement_prompts=5 needs 5 prompts"):
        agreement_prompts(heldout, 5, 4)


def test_the_eval_stage_takes_it_when_asked_and_reuses_it(tmp_path):
    base = RunConfig()
    cfg = dataclasses.replace(base, eval=dataclasses.replace(base.eval, attention_error=False, agreement_prompts=3,
                                                             agreement_prompt_len=8, agreement_tokens=6,
                                                             mqar=True, mqar_seq_lens=[16], mqar_examples=2,
                                                             memory_contexts=[32]))
    heldout = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    student = convert(teacher(), feature_map="softmax")
    metrics = evaluate(cfg, teacher(), student, heldout, tmp_path)
    assert metrics["agreement/first_token"] == 1.0 and metrics["agreement/prefix_len"] == 6
    assert json.loads((tmp_path / "metrics.json").read_text())["agreement/prefix_len"] == 6
    stored = json.loads((tmp_path / MEASUREMENTS).read_text())
    assert [k.split("-")[0] for k in sorted(stored)] == [
        "agreement", "memory/student", "memory/teacher", "mqar/student", "mqar/teacher", "perplexity/student",
        "perplexity/teacher"]  # each registered measurement the config enables, and no other
    sequences = json.loads((tmp_path / "eval_sequences.json").read_text())
    agreement = next(v for k, v in sequences.items() if k.startswith("agreement"))
    assert agreement["seq/agreement/first_token"] == [1.0, 1.0, 1.0]
    before = (tmp_path / MEASUREMENTS).stat().st_mtime_ns
    assert evaluate(cfg, teacher(), student, heldout, tmp_path) == metrics
    assert (tmp_path / MEASUREMENTS).stat().st_mtime_ns == before  # nothing taken again
