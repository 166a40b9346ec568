"""``dofla-eval DIR``: the project's evaluation of a saved student or any Hugging Face model directory."""
from __future__ import annotations

import math

import pytest
import torch

from dofla.cli import eval_main
from dofla.data import build_source, pack_tokens
from dofla.eval import heldout_loss
from dofla.models import convert
from dofla.models.tiny import build_byte_tokenizer, build_tiny_model
from dofla.record import read_json

OVERRIDES = ["experiment=smoke_tiny", "eval.mqar=true", "eval.mqar_seq_lens=[32]", "eval.mqar_examples=4",
             "eval.position_buckets=[0,16,64]", "eval.long_seq_len=64", "eval.long_context_seqs=2"]


def _heldout(tokenizer) -> torch.Tensor:  # what experiment=smoke_tiny holds out (seq_len 64, 256 tokens)
    return pack_tokens(build_source("embedded").texts("heldout"), tokenizer, 64, 256)


@pytest.mark.parametrize("kind", ["student", "teacher"])
def test_dofla_eval_measures_a_saved_model(kind, tmp_path, capsys):
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model("llama", seed=0)
    if kind == "student":
        model = convert(model, feature_map="learned_prf", dims=[8, 8]).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    eval_main([str(tmp_path / "model"), "--out", str(tmp_path / "out"), *OVERRIDES])
    metrics = read_json(tmp_path / "out" / "metrics.json")
    expected = heldout_loss(model, _heldout(tokenizer), 2)
    assert metrics["eval/model_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["eval/model_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert {"position/model/0-16", "position/model/16-64", "mqar/model/T32"} <= set(metrics)
    assert "wrote" in capsys.readouterr().out

    before = (tmp_path / "out" / "eval_measurements.json").stat().st_mtime_ns
    eval_main([str(tmp_path / "model"), "--out", str(tmp_path / "out"), *OVERRIDES])  # nothing to redo
    assert (tmp_path / "out" / "eval_measurements.json").stat().st_mtime_ns == before
    assert read_json(tmp_path / "out" / "metrics.json") == metrics


def test_dofla_eval_refuses_what_it_cannot_evaluate_in_one_sentence(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        eval_main([str(tmp_path), "--out", str(tmp_path / "out"), "experiment=smoke_tiny"])
    assert "has no config.json" in str(exit_.value.code) and "\n" not in str(exit_.value.code)
    with pytest.raises(SystemExit) as exit_:
        eval_main([str(tmp_path), "--out", str(tmp_path / "out"), "eval=no_such_eval"])
    assert "no_such_eval" in str(exit_.value.code)
