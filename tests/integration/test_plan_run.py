"""A per-head plan through the real ``dofla`` command: a tiny Llama of four KV heads whose first layer holds
an exact head, a window with sinks, a window before a gated-delta state and a pure gated-delta state, and
whose second holds additive states (one with per-head dims) beside exact heads. One CLI start runs it
twice (train.source=cache and stream), each trained layerwise and then with KL; the students decode as their
full forward, save and load as themselves, and measure the decode memory their plan predicts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dofla.models import convert, load_student
from dofla.models.mixed_attention import MixedAttention
from dofla.models.plan import ALL, StudentPlan
from dofla.models.tiny import build_byte_tokenizer
from dofla.report import collect_record, load_record
from dofla.report.records import run_record
from tests.component.test_mixed_heads import _teacher
from tests.component.test_student import _greedy_by_parallel_forward, _ids
from tests.integration.test_pipeline import run_cli

PLAN = [
    [{"window": ALL}, {"window": 4, "sinks": 2}, {"window": 3, "state": "delta", "M": 8}, {"state": "delta", "M": 4}],
    [{"state": "additive", "M": 8}, {"window": 4, "sinks": 1, "state": "additive", "M": [4, 8]},
     {"window": ALL}, {"window": ALL}],
]
CONTEXTS = [8, 40, 1000]
SOURCES = ("cache", "stream")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_run")
    teacher = root / "teacher"
    _teacher().save_pretrained(teacher)
    build_byte_tokenizer().save_pretrained(teacher)
    (root / "plan.json").write_text(json.dumps(PLAN))
    result = run_cli("-m", "experiment=smoke_tiny", f"model.source={teacher}", f"attention.plan={root / 'plan.json'}",
                     "loss=output", "distill=kl", "distill.tokens=2048",
                     f"eval.memory_contexts=[{','.join(map(str, CONTEXTS))}]",
                     f"train.source={','.join(SOURCES)}", f"hydra.sweep.dir={root / 'runs'}",
                     "hydra.sweep.subdir=${train.source}", f"paths.cache_dir={root / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return {source: root / "runs" / source for source in SOURCES}


def test_every_group_with_features_trains_layerwise_from_its_source(runs):
    for source in SOURCES:  # both runs of the one CLI start
        run = runs[source]
        assert json.loads((run / "run.json").read_text())["train_source"] == source
        assert not (run / "allocation.json").exists()  # the plan's M are the dims
        summary = json.loads((run / "train_summary.json").read_text())
        assert sorted(summary) == ["layer_00", "layer_01"]
        for layer in summary.values():
            assert layer["final_heldout_loss"] < layer["initial_heldout_loss"]
        meta = json.loads((run / "layers" / "layer_00.pt.json").read_text())["meta"]
        assert meta["num_features"] == [8, 4] and meta["plan"].startswith("sha256:")  # its two groups with features
        settings = json.loads((run / "student" / "dofla_settings.json").read_text())
        assert settings["attention"]["plan"] == meta["plan"]


def test_kl_moves_every_group_and_the_students_save_and_load_as_themselves(runs):
    for source in SOURCES:  # both runs of the one CLI start
        run = runs[source]
        assembled, distilled = load_student(run / "student"), load_student(run / "student_distilled")
        assert distilled.config.dofla["plan"] == StudentPlan.from_list(PLAN).to_list()
        layers = distilled.student_attentions()
        assert all(isinstance(layer, MixedAttention) for layer in layers)
        assert [layer.groups for layer in layers] == [[[0], [1], [2], [3]], [[0], [1], [2, 3]]]
        fresh = dict(convert(_teacher(), feature_map="learned_prf", plan=PLAN).named_parameters())
        trained = [name for name, p in assembled.named_parameters() if ".dofla.parts." in name
                   and not torch.equal(p, fresh[name])]  # the layerwise artifacts, loaded group by group
        before = dict(assembled.named_parameters())
        moved = [name for name, p in distilled.named_parameters() if ".dofla.parts." in name
                 and not torch.equal(p, before[name])]
        for group in ("layers.0.self_attn.dofla.parts.2.", "layers.0.self_attn.dofla.parts.3.",
                      "layers.1.self_attn.dofla.parts.0.", "layers.1.self_attn.dofla.parts.1."):
            assert any(group in name for name in trained) and any(group in name for name in moved), group
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["distill/tokens"] == 2048


def test_the_student_decodes_as_its_full_forward(runs):
    for source in SOURCES:  # both runs of the one CLI start
        student = load_student(runs[source] / "student_distilled")
        prompt = _ids(batch=1, length=9)
        generated = student.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=256)
        assert torch.equal(generated, _greedy_by_parallel_forward(student, prompt, 12))


def test_the_measured_decode_memory_is_the_plans(runs):
    for source in SOURCES:  # both runs of the one CLI start
        metrics = json.loads((runs[source] / "metrics.json").read_text())
        for context in CONTEXTS:
            measured = metrics[f"memory/student/decode_mib/T{context}"]
            assert measured == metrics[f"memory/student/plan_mib/T{context}"] > 0
        assert metrics["memory/student/decode_mib/T1000"] < metrics["memory/teacher/decode_mib/T1000"]


def test_the_record_holds_the_plan_the_file_held(runs, tmp_path):
    run = runs["cache"]
    given = Path(json.loads((run / "run.json").read_text())["config"]["attention"]["plan"])
    expected = StudentPlan.from_list(PLAN).to_list()
    record = load_record(collect_record(run, tmp_path / "records"))
    assert record.plan == run_record(run).plan == expected  # the plan itself, not the file's path
    kept = given.read_text()
    given.unlink()
    try:
        with pytest.raises(FileNotFoundError, match="plan file .* is gone"):
            collect_record(run, tmp_path / "again")
        assert load_record(tmp_path / "records" / run.name).plan == expected  # a kept record needs no file
    finally:
        given.write_text(kept)  # the module's other tests read the run as it was
