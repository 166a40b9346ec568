"""``attention.plan``: a plan given whole, through real Hydra composition. Its key is the plan it holds (not
the file's path or format) and is absent at the default, its errors are one sentence before any model
loads, and it replaces the dof and allocate stages."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.errors import ConfigError
from dofla.models.plan import ALL
from dofla.pipeline import check_before_loading
from dofla.stages.keys import attention_settings, layer_meta, softmax_ranking_settings, student_settings
from dofla.stages.plan import stage_plan
from dofla.stages.students import linear_layers, plan_dims
from tests.component.test_mixed_heads import _config

# tiny:llama: 2 layers, 4 query heads reading 2 KV heads of 16
PLAN = [[{"window": ALL}, {"window": 4, "state": "delta", "M": 8}],
        [{"state": "additive", "M": [4, 8]}, {"window": 4, "sinks": 2}]]


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", f"paths.cache_dir={tmp_path / 'cache'}", *overrides]))


def _plan_file(tmp_path, plan=PLAN, name="plan.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(plan) if name.endswith(".json")
                    else "layers:\n" + "".join(f"  - {json.dumps(layer)}\n" for layer in plan))
    return str(path)


def test_without_a_plan_no_key_names_one(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.attention.plan is None
    assert "plan" not in attention_settings(cfg) and "plan" not in layer_meta(cfg, "k")
    assert "attention" not in softmax_ranking_settings(cfg, {})


def test_the_key_is_the_plan_it_holds_not_its_file(tmp_path):
    as_json = _cfg(tmp_path, f"attention.plan={_plan_file(tmp_path)}", "loss=output")
    as_yaml = _cfg(tmp_path, f"attention.plan={_plan_file(tmp_path, name='moved.yaml')}", "loss=output")
    edited = [PLAN[0], [PLAN[1][0], {"window": 5, "sinks": 2}]]
    other = _cfg(tmp_path, f"attention.plan={_plan_file(tmp_path, edited, 'edited.json')}", "loss=output")
    digest = attention_settings(as_json)["plan"]
    assert digest.startswith("sha256:") and attention_settings(as_yaml)["plan"] == digest
    assert attention_settings(other)["plan"] != digest
    assert layer_meta(as_json, "k")["plan"] == digest and layer_meta(other, "k")["plan"] != digest
    dims = [8, 8]
    assert student_settings(as_json, "k", dims) == student_settings(as_yaml, "k", dims)
    assert student_settings(as_json, "k", dims) != student_settings(other, "k", dims)
    assert student_settings(as_json, "k", dims) != student_settings(_cfg(tmp_path, "loss=output"), "k", dims)


def test_a_plan_sets_the_dims_and_replaces_dof_and_allocate(tmp_path):
    cfg = _cfg(tmp_path, f"attention.plan={_plan_file(tmp_path)}", "loss=output", "allocation=dof")
    assert stage_plan(cfg) == ["cache", "train", "assemble", "eval", "report"]

    class Geometry:
        num_layers, num_heads, num_kv_heads, head_dim, layer_windows = 2, 4, 2, 16, None

    assert plan_dims(cfg, Geometry) == [[0, 0, 8, 8], [4, 8, 0, 0]]
    assert linear_layers(cfg, Geometry) == [0, 1]
    window_only = [PLAN[0], [{"window": ALL}, {"window": 4, "sinks": 2}]]
    cfg = _cfg(tmp_path, f"attention.plan={_plan_file(tmp_path, window_only, 'w.json')}", "loss=output")
    assert linear_layers(cfg, Geometry) == [0]


@pytest.mark.parametrize("plan, overrides, sentence", [
    (PLAN[:1], [], "the plan has 1 layers but the model has 2"),
    ([PLAN[0][:1], PLAN[1]], [], "layer 0 of the plan has 1 heads but the model has 2 key/value heads"),
    (PLAN, ["attention=hybrid"], r"sets every head's .*; drop attention.name=hybrid, attention.window=64"),
    (PLAN, ["loss=softmax"], "has gated-delta heads, which have no kernel for loss=softmax"),
    (PLAN, ["allocation.softmax_layers=1"], "drop allocation.softmax_layers"),
    ("not a plan", [], "holds no list of layers"),
])
def test_a_wrong_plan_is_one_sentence_before_any_model_loads(tmp_path, plan, overrides, sentence):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    cfg = _cfg(tmp_path, f"attention.plan={path}", "loss=output", *overrides)
    with pytest.raises(ConfigError, match=sentence) as caught:
        check_before_loading(cfg, tmp_path / "run")
    assert str(caught.value).count(". ") == 0 and "attention.plan" in str(caught.value)


def test_a_missing_plan_file_is_one_sentence(tmp_path):
    cfg = _cfg(tmp_path, f"attention.plan={tmp_path / 'absent.yaml'}", "loss=output")
    with pytest.raises(ConfigError, match="absent.yaml does not exist"):
        check_before_loading(cfg, tmp_path / "run")


def test_a_directorys_plan_is_checked_from_its_config_alone(tmp_path):
    """A model directory holding only its config.json (no weights, no tokenizer): the plan is refused from it."""
    _config().save_pretrained(tmp_path / "model")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))  # two KV heads a layer; this model has four
    cfg = _cfg(tmp_path, f"model.source={tmp_path / 'model'}", f"attention.plan={path}", "loss=output")
    with pytest.raises(ConfigError, match="layer 0 of the plan has 2 heads but the model has 4 key/value heads"):
        check_before_loading(cfg, tmp_path / "run")
