"""Every config group option composes and converts to the typed RunConfig; bad values fail early."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dofla.cli import CONF_DIR, to_run_config
from dofla.config import RunConfig

GROUPS = ["model", "data", "feature_map", "attention", "finetune", "loss", "allocation", "budget", "train", "eval", "logger", "experiment"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _compose(overrides: list[str]) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


def test_default_config_is_the_embedded_pipeline():
    cfg = _compose([])
    assert cfg.model.source == "embedded:smollm2-135m-instruct"
    assert (cfg.feature_map.name, cfg.loss.name, cfg.allocation.policy) == ("learned_prf", "softmax", "dof")
    assert cfg.data.name == "embedded" and cfg.budget.multiple == 1.0


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=lambda x: str(x)
)
def test_every_option_composes_to_typed_config(group, option):
    cfg = _compose([f"{group}={option}"])
    assert isinstance(cfg, RunConfig)
    if group in ("feature_map", "attention", "finetune", "data", "eval", "logger", "budget"):
        assert getattr(cfg, group).name == option
    if group == "allocation":
        assert cfg.allocation.policy == option
    if group == "loss":
        assert cfg.loss.name == option


def test_option_file_names_match_registries():
    from dofla.data import DATA_SOURCES
    from dofla.dof import ALLOCATION_POLICIES
    from dofla.feature_maps import FEATURE_MAPS
    from dofla.train.losses import LOSSES

    assert set(_options("feature_map")) == set(FEATURE_MAPS.names())
    assert set(_options("allocation")) == set(ALLOCATION_POLICIES.names())
    assert set(_options("loss")) == {*LOSSES.names(), "direct"}  # the layer losses, and the direct training mode
    assert set(_options("data")) == set(DATA_SOURCES.names())


def test_unknown_option_lists_valid_choices():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        _compose(["feature_map=performr"])
    assert "performer" in str(err.value) and "learned_prf" in str(err.value)


def test_wrong_type_fails_at_composition():
    with pytest.raises(Exception) as err:
        _compose(["allocation.lam=abc"])
    assert "lam" in str(err.value)


def test_resolved_config_roundtrips_through_yaml():
    cfg = _compose(["experiment=smoke_tiny"])
    assert cfg.model.source == "tiny:llama" and cfg.data.seq_len == 64
    assert OmegaConf.to_yaml(OmegaConf.structured(cfg))


@pytest.mark.parametrize("variant", _options("variant"))
def test_every_paper_grid_cell_composes(variant):
    cfg = _compose(["experiment=paper_gpt2", f"+variant={variant}"])
    assert cfg.model.source == "gpt2" and cfg.allocation.gram_norm == "J" and cfg.allocation.lam == 0.0625
    policy, _, loss = variant.rpartition("_")
    if variant not in ("performer", "dijiang"):
        assert (cfg.allocation.policy, cfg.loss.name, cfg.feature_map.name) == (policy, loss, "learned_prf")
    else:
        assert cfg.feature_map.name == variant and cfg.allocation.policy == "fix"


def _grid(experiment: str) -> list[str]:
    text = (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text()
    return OmegaConf.create(text)["hydra"]["sweeper"]["params"]["+variant"].split(",")


def test_the_cpu_grid_lists_all_fourteen_cells():
    assert sorted(_grid("paper_grid_smollm2")) == sorted(_options("variant"))


# What the paper states for each run (docs/method.md lists what it does not state, with the choice).
PAPER_CELLS = ["fix_direct", "fix_softmax", "fix_l2", "dof_direct", "dof_softmax", "dof_l2", "dof_clip_direct",
               "dof_clip_softmax", "dof_clip_l2", "performer", "dijiang"]
PAPER = {
    "paper_gpt2": {"model": "gpt2", "head_dim": 64, "seq_len": 1024, "batch": 128, "C": 64, "lam": 2**-4,
                   "cells": PAPER_CELLS, "lr_grid": [1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4]},
    "paper_pythia1b": {"model": "EleutherAI/pythia-1b", "head_dim": 256, "seq_len": 2048, "batch": 64, "C": 128,
                       "lam": 2**-8, "cells": ["fix_softmax", "dof_softmax"],
                       "lr_grid": [1e-7, 5e-7, 1e-6, 5e-6, 1e-5, 5e-5]},
}


@pytest.mark.parametrize("experiment", sorted(PAPER))
def test_the_paper_experiments_compose_the_papers_settings(experiment):
    from dofla.eval.suite import finetune_batch_sizes
    from dofla.validate import feature_budget, validate_config

    paper = PAPER[experiment]
    assert _grid(experiment) == paper["cells"]
    for cell in paper["cells"]:
        cfg = _compose([f"experiment={experiment}", f"+variant={cell}"])
        validate_config(cfg)
        assert cfg.model.source == paper["model"] and cfg.data.seq_len == paper["seq_len"]
        # tokens: one pass over a random 10 % of English Wikipedia, read from the prepared subset
        assert (cfg.data.name, cfg.data.options["fraction"], cfg.data.num_tokens) == ("wikipedia", 0.1, "all")
        assert cfg.data.prepared == "require" and cfg.train.source == "stream"
        assert cfg.data.shuffle_seed == 0  # a random order: the sample is drawn from the whole subset
        # the effective batch, layerwise and end to end; micro-batches only bound the memory
        assert cfg.train.batch_size == cfg.train.direct_batch_size == paper["batch"]
        assert cfg.train.micro_batch_size == "auto"  # what fits the GPU, from the memory preflight
        assert feature_budget(cfg, paper["head_dim"]) == paper["C"]
        # Algorithm 1 in the paper's form
        a = cfg.allocation
        assert (a.gram_norm, a.lam, a.num_samples, a.resamples, a.head_aggregate) == ("J", paper["lam"], 2048, 1, "max")
        assert cfg.data.cache_tokens * 2 >= 10 * a.num_samples  # the pooled q∪k sample holds ≥ 10·J vectors
        # the evaluation: the seven tasks, each model fine-tuned per task, 3 epochs, six learning rates
        ev = cfg.eval
        assert (ev.tasks, ev.protocol, ev.finetune_epochs) == (["downstream7"], "finetune", 3)
        assert ev.finetune_lr_grid == pytest.approx(paper["lr_grid"])
        assert ev.finetune_train_data == {"mmlu": {"path": "cais/mmlu", "name": "auxiliary_train", "split": "train"}}
        assert all(32 <= n <= 128 for n in finetune_batch_sizes(ev).values())


@pytest.mark.parametrize("experiment", sorted(PAPER))
def test_a_grid_named_on_the_command_line_replaces_the_papers(experiment):
    """What docs/guide/paper.md tells a user to type for extra cells, through Hydra's own sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def jobs(arguments):
        params = [f"+variant={','.join(_grid(experiment))}", *arguments]  # the config's grid first, as Hydra does
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params), None)
        return [job[0] for job in batches[0]]

    assert jobs([]) == [f"+variant={cell}" for cell in PAPER[experiment]["cells"]]
    wider = [*PAPER[experiment]["cells"], "dof_head_softmax"]
    assert jobs([f"+variant={','.join(wider)}"]) == [f"+variant={cell}" for cell in wider]


@pytest.mark.parametrize("group,option", [(g, o) for g in ("feature_map", "loss", "data") for o in _options(g)])
def test_every_shipped_option_file_passes_the_typed_option_check(group, option):
    from dofla.validate import validate_config

    cfg = _compose([f"{group}={option}"])
    if option in ("text_files", "parquet"):  # the shipped files leave paths empty on purpose: the user names them
        cfg.data.options["paths"] = ["corpus.txt"]
    validate_config(cfg)


def test_help_introduces_the_tool_groups_and_examples(tmp_path):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dofla", "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("dofla: distil") and "powered by Hydra" not in done.stdout
    for group in ("allocation", "data", "feature_map", "loss", "model", "experiment"):
        listed = next(line for line in lines if line.startswith(f"{group}: "))
        assert listed.removeprefix(f"{group}: ").split(", ") == _options(group)
    examples = [line.strip() for line in lines if line.strip().startswith("dofla ")]
    assert len(examples) >= 3 and "== Examples ==" in done.stdout


@pytest.mark.parametrize("overrides", [[f"experiment={e}"] for e in _options("experiment")]
                         + [["experiment=paper_gpt2", f"+variant={v}"] for v in _options("variant")], ids=str)
def test_every_experiment_and_grid_cell_passes_validation(overrides):
    from dofla.dof.allocate import reads_dof
    from dofla.validate import stage_plan, validate_config

    cfg = _compose(overrides)
    validate_config(cfg)
    # Algorithm 1 runs for the policies that read it: not fix, not a memory budget's measured plan
    assert ("dof" in stage_plan(cfg)) == reads_dof(cfg.allocation.policy) == (cfg.allocation.policy not in ("fix", "budget"))


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("64", 64)])
def test_the_chunk_size_composes_as_a_number_or_auto(value, expected):
    from dofla.validate import validate_config

    cfg = _compose([f"attention.chunk_size={value}"])
    assert cfg.attention.chunk_size == expected
    validate_config(cfg)
