"""``allocation=budget budget=memory``: the memory-budget allocator through real Hydra composition. Its
checks are one sentence each before any model loads, it runs the allocate stage without Algorithm 1, the
eval measures decode memory at the budget's context, and the existing budgets keep their meaning."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.dof.budget import memory_budget
from dofla.errors import ConfigError
from dofla.models.plan import ALL
from dofla.pipeline import check_before_loading
from dofla.report.seeds import settings_key
from dofla.stages.plan import stage_plan

BUDGET = ["allocation=budget", "budget=memory", "budget.mib=1", "budget.context=256", "loss=output",
          "budget.windows=[4,8]", "budget.states=[4,8]", "budget.prompt_length=120"]


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[
            "experiment=smoke_tiny", f"paths.cache_dir={tmp_path / 'cache'}", *overrides]))


def _refused(tmp_path, *overrides) -> str:
    with pytest.raises(ConfigError) as error:
        check_before_loading(_cfg(tmp_path, *overrides), tmp_path / "run")
    message = str(error.value)
    assert message.count(". ") == 0 and "\n" not in message  # one sentence
    return message


def test_the_memory_section_maps_onto_the_allocators_config(tmp_path):
    cfg = _cfg(tmp_path, *BUDGET, "budget.kl_weight=0.5", "budget.repair_rounds=2", "feature_map=hedgehog")
    memory = memory_budget(cfg)
    assert (memory.mib, memory.share, memory.context, memory.windows, memory.states) == (1, None, 256, [4, 8], [4, 8])
    assert memory.kl_weight == 0.5 and memory.feature_map == "hedgehog" and cfg.budget.repair_rounds == 2
    shared = memory_budget(_cfg(tmp_path, *BUDGET[:2], "budget.share=0.1", "loss=output"))
    assert shared.share == 0.1 and shared.mib is None and shared.windows == [64, 256, 1024]
    assert (shared.reuse_prefix, shared.granularity, shared.solver) == (True, "head", "milp")
    ablation = memory_budget(_cfg(tmp_path, *BUDGET, "budget.reuse_prefix=false", "budget.granularity=layer",
                                  "budget.solver=random"))
    assert (ablation.reuse_prefix, ablation.granularity, ablation.solver) == (False, "layer", "random")


def test_the_allocation_runs_without_dof_and_eval_measures_memory_at_the_budgets_context(tmp_path):
    cfg = _cfg(tmp_path, *BUDGET)
    assert stage_plan(cfg) == ["cache", "allocate", "train", "assemble", "eval", "report"]
    checked, *_ = check_before_loading(cfg, tmp_path / "run")
    assert checked.eval.memory_contexts == [256]
    again, *_ = check_before_loading(_cfg(tmp_path, *BUDGET, "eval.memory_contexts=[256,64]"), tmp_path / "run2")
    assert again.eval.memory_contexts == [256, 64]  # already there: unchanged


def test_existing_budgets_and_policies_keep_their_meaning(tmp_path):
    cfg = _cfg(tmp_path)
    assert (cfg.allocation.policy, cfg.budget.name, cfg.budget.mib, cfg.budget.share) == ("dof", "head_dim", None, None)
    checked, *_ = check_before_loading(cfg, tmp_path / "run")
    assert checked.eval.memory_contexts == cfg.eval.memory_contexts
    assert "dof" in stage_plan(cfg) and "allocate" in stage_plan(cfg)


@pytest.mark.parametrize("overrides, words", [
    (["allocation=budget"], "add budget=memory"),
    (["budget=memory", "budget.mib=1"], "add allocation=budget"),
    (["allocation=budget", "budget=memory", "loss=output"], "exactly one of them"),
    (["allocation=budget", "budget=memory", "budget.mib=1", "budget.share=0.1", "loss=output"], "exactly one"),
    ([*BUDGET[:-1], "budget.prompt_length=8"], "longer than the largest window"),
    ([*BUDGET, "data.seq_len=8"], "longer than the largest window"),
    ([*BUDGET[:4], "loss=direct", "budget.windows=[4]", "budget.prompt_length=120", "budget.calibration_seqs=0"],
     "budget.calibration_seqs=0 must be a positive number"),
    ([*BUDGET[:4], "budget.windows=[4]", "budget.prompt_length=120"], "use loss=output or loss=direct"),
    ([*BUDGET, "attention=sliding_window"], "drop attention.name=sliding_window"),
    ([*BUDGET, "allocation.softmax_layers=1"], "drop allocation.softmax_layers"),
])
def test_each_bad_setting_is_one_sentence_before_loading(tmp_path, overrides, words):
    assert words in _refused(tmp_path, *overrides)


def test_a_plan_given_whole_and_the_allocator_are_exclusive(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([[{"window": ALL}, {"window": 4}], [{"window": ALL}, {"window": 4}]]))
    assert "drop one of them" in _refused(tmp_path, *BUDGET, f"attention.plan={path}")


def test_windows_and_exact_heads_alone_need_no_output_loss(tmp_path):
    check_before_loading(_cfg(tmp_path, *BUDGET[:4], "budget.windows=[4,8]", "budget.states=[]",
                              "budget.prompt_length=120"), tmp_path / "run")


def test_runs_recorded_before_the_memory_fields_still_group_with_their_seeds(tmp_path):
    now = asdict(_cfg(tmp_path).budget)
    before = {k: now[k] for k in ("name", "value", "multiple")}
    assert settings_key({"budget": before}) == settings_key({"budget": now})
    assert settings_key({"budget": before}) != settings_key({"budget": {**now, "mib": 32}})
