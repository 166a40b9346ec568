"""Bad config values fail before any model is loaded, with one sentence naming the key."""
from __future__ import annotations

import dataclasses

import pytest

from dofla.config import RunConfig
from dofla.validate import ConfigError, validate_against_model, validate_config, validate_output_dir
from dofla.world import validate_world


def _cfg(**changes) -> RunConfig:
    cfg = RunConfig()
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if key:
            setattr(getattr(cfg, section), key, value)
        else:
            setattr(cfg, section, value)
    return cfg


BAD_BEFORE_MODEL = [
    ({"feature_map__name": "performr"}, "feature_map.name"),
    ({"loss__name": "kl"}, "loss.name"),
    ({"allocation__policy": "dof_head_x"}, "allocation.policy"),
    ({"allocation__gram_norm": "frobenius"}, "allocation.gram_norm"),
    ({"data__name": "wikipedai"}, "data.name"),
    ({"train__schedule": "linear"}, "train.schedule"),
    ({"allocation__lam": 0.0}, "allocation.lam"),
    ({"allocation__lam": -1e-3}, "allocation.lam"),
    ({"allocation__num_samples": 0}, "allocation.num_samples"),
    ({"data__seq_len": 0}, "data.seq_len"),
    ({"data__num_tokens": -5}, "data.num_tokens"),
    ({"data__heldout_tokens": 0}, "data.heldout_tokens"),
    ({"data__prefetch": -1}, "data.prefetch"),
    ({"budget__multiple": 0.0}, "budget.multiple"),
    ({"budget__value": -64}, "budget.value"),
    ({"train__batch_size": 0}, "train.batch_size"),
    ({"train__steps": -1}, "train.steps"),
    ({"train__lr_z": 0}, "train.lr_z"),
    ({"train__heldout_fraction": 1.0}, "train.heldout_fraction"),
    ({"train__checkpoint_every": 0}, "train.checkpoint_every"),
    ({"eval__batch_size": 0}, "eval.batch_size"),
    ({"attention__chunk_size": 0}, "attention.chunk_size"),
    ({"attention__window": -4}, "attention.window"),
    ({"finetune__name": "qlora"}, "finetune.name"),
    ({"finetune__rank": 0}, "finetune.rank"),
    ({"train__micro_batch_size": 0}, "train.micro_batch_size"),
    ({"train__micro_batch_size": 1, "loss__name": "output"}, "train.micro_batch_size"),
    ({"distill__name": "mse"}, "distill.name"),
    ({"distill__name": "kl", "distill__train": ["mlp"]}, "distill.train"),
    ({"distill__name": "kl", "distill__train": []}, "distill.train"),
    ({"distill__name": "kl", "distill__batch_size": 4, "distill__micro_batch_size": 3}, "distill.micro_batch_size"),
    ({"distill__name": "kl", "distill__tokens": 100}, "distill.tokens"),
    ({"distill__name": "kl", "distill__temperature": 0}, "distill.temperature"),
    ({"distill__name": "kl", "distill__schedule": "linear"}, "distill.schedule"),
    ({"distill__name": "kl", "distill__offset": -1}, "distill.offset"),
    ({"distill__name": "kl", "distill__micro_batch_size": "big"}, "distill.micro_batch_size"),
    ({"distill__name": "kl", "distill__logit_chunk": -1}, "distill.logit_chunk"),
    ({"data__num_tokens": 100, "data__seq_len": 512}, "data.num_tokens"),
    ({"stages": ["cache", "trian"]}, "stages"),
    ({"logger__name": "tensorboard"}, "logger.name"),
    ({"device": "gpu"}, "device"),
    ({"train__teacher_dtype": "fp16"}, "train.teacher_dtype"),
    ({"device": "cuda:x"}, "device"),
    ({"train__parallel": "tensor"}, "train.parallel"),
    ({"train__parallel": "data", "train__source": "cache"}, "train.parallel"),
    ({"allocation__softmax_layers": -1}, "allocation.softmax_layers"),
    ({"allocation__softmax_probe_seqs": 0}, "allocation.softmax_probe_seqs"),
    ({"allocation__softmax_rank": "error"}, "allocation.softmax_rank"),
    ({"allocation__softmax_layers": 1, "allocation__softmax_rank": "passkey"}, "eval.passkey_lengths"),
    ({"train__hybrid_target": "window"}, "train.hybrid_target"),
    ({"train__hybrid_target": "full"}, "train.hybrid_target"),  # pure linear: no hybrid layers
    ({"train__hybrid_target": "full", "attention__name": "hybrid", "attention__window": 64, "loss__name": "direct"},
     "train.hybrid_target"),
    ({"distill__name": "kl", "attention__name": "hybrid", "attention__window": 64, "distill__window_dropout": 1.5},
     "distill.window_dropout"),
    ({"distill__name": "kl", "attention__name": "hybrid", "attention__window": 64,
      "distill__window_dropout_end": -0.1}, "distill.window_dropout_end"),
    ({"distill__name": "kl", "distill__window_dropout": 0.5}, "distill.window_dropout"),  # pure linear
    ({"attention__name": "hybrid", "attention__window": 64, "distill__window_dropout": 0.5}, "distill.window_dropout"),
    ({"attention__gate": "lizard"}, "attention.gate"),
    ({"attention__gate": "scalar"}, "attention.gate"),  # no distill stage to train it
    ({"attention__gate": "scalar", "distill__name": "kl"}, "attention.gate"),  # gate not in distill.train
    ({"attention__gate": "scalar", "attention__name": "sliding_window", "attention__window": 64, "distill__name": "kl",
      "distill__train": ["features", "gate"]}, "attention.gate"),  # no linear state to decay
    ({"train__compile": True, "loss__name": "direct"}, "train.compile"),  # no layer loss to compile
    ({"attention__linear_scale": "per_token"}, "attention.linear_scale"),
    ({"attention__linear_scale": "learned", "distill__name": "kl"}, "attention.linear_scale"),  # pure linear: cancels
    ({"attention__linear_scale": "learned", "attention__name": "hybrid", "attention__window": 64},
     "attention.linear_scale"),  # no distill stage to train it
    ({"attention__linear_scale": "learned", "attention__name": "hybrid", "attention__window": 64, "distill__name": "kl",
      "distill__train": ["attention"]}, "attention.linear_scale"),  # trains with the features, not named
    ({"distill__name": "kl", "distill__copy_share": 0.8}, "distill.copy_share"),
    ({"distill__name": "kl", "distill__copy_distance": 0}, "distill.copy_distance"),
    ({"distill__name": "kl", "distill__copy_share": 0.1, "distill__seq_len": 128}, "distill.copy_share"),  # too short
    ({"allocation__policy": "given"}, "allocation.dims"),  # no dims
    ({"allocation__policy": "given", "allocation__dims": [64, 0]}, "allocation.dims"),
]


@pytest.mark.parametrize("changes,key", BAD_BEFORE_MODEL, ids=[k for _, k in BAD_BEFORE_MODEL])
def test_bad_value_names_its_key(changes, key):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(**changes))
    message = str(err.value)
    assert key in message and "\n" not in message


BAD_FOR_MODEL = [
    ({"budget__value": 0.5}, "at least 1"),
    ({"allocation__policy": "dof_clip", "budget__multiple": 2.0}, "dof_clip"),
    ({"train__layers": [0, 30]}, "train.layers"),
    ({"train__layers": [-1]}, "train.layers"),
    ({"data__seq_len": 4096}, "data.seq_len"),
    ({"distill__name": "kl", "distill__seq_len": 4096, "distill__tokens": 16384}, "distill.seq_len"),
    ({"allocation__softmax_layers": 30}, "allocation.softmax_layers"),
    ({"allocation__policy": "given", "allocation__dims": [64] * 29}, "allocation.dims has 29 dims, the model 30 layers"),
]


@pytest.mark.parametrize("changes,needle", BAD_FOR_MODEL, ids=[n for _, n in BAD_FOR_MODEL])
def test_bad_value_for_the_model_geometry(changes, needle):
    cfg = _cfg(**changes)
    validate_config(cfg)
    with pytest.raises(ConfigError) as err:
        validate_against_model(cfg, num_layers=30, head_dim=64, max_positions=2048)
    assert needle in str(err.value)


def test_good_defaults_pass():
    cfg = RunConfig()
    validate_config(cfg)
    validate_against_model(cfg, num_layers=30, head_dim=64, max_positions=2048)
    assert dataclasses.asdict(cfg)["allocation"]["policy"] == "dof"


@pytest.mark.parametrize("form", [{}, {"attention__name": "hybrid", "attention__window": 64}], ids=["linear", "hybrid"])
def test_a_gate_distilled_by_kl_passes_on_linear_and_hybrid_layers(form):
    validate_config(_cfg(attention__gate="scalar", distill__name="kl", distill__train=["features", "gate"], **form))


def test_a_learned_linear_scale_distilled_by_kl_passes_on_a_hybrid():
    validate_config(_cfg(attention__linear_scale="learned", attention__name="hybrid", attention__window=64,
                         distill__name="kl", distill__train=["features", "attention"]))


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as err:
        validate_output_dir(blocker / "run")
    assert "output directory" in str(err.value)


BAD_OPTIONS = [
    ({"feature_map__options": {"alpha_parm": "log"}}, "feature_map.options.alpha_parm",
     "did you mean 'alpha_param'?"),
    ({"feature_map__options": {"bogus": 3}}, "feature_map.options.bogus", "valid options: alpha_param"),
    ({"feature_map__name": "performer", "feature_map__options": {"alpha_param": "log"}},
     "feature_map.options.alpha_param", "valid options: none"),
    ({"feature_map__options": {"alpha_param": 1}}, "feature_map.options.alpha_param=1", "must be str"),
    ({"feature_map__name": "hedgehog", "feature_map__options": {"init_std": "small"}}, "init_std", "must be float"),
    ({"feature_map__name": "hedgehog", "feature_map__options": {"init_std": True}}, "init_std", "got bool"),
    ({"loss__name": "l2", "loss__options": {"scael": "none"}}, "loss.options.scael", "did you mean 'scale'?"),
    ({"loss__name": "softmax", "loss__options": {"window": 4}}, "loss.options.window", "valid options: none"),
    ({"loss__name": "direct", "loss__options": {"scale": "none"}}, "loss.options.scale", "valid options: none"),
    ({"data__name": "text_files", "data__options": {"paths": ["a.txt"], "text_feild": "body"}},
     "data.options.text_feild", "did you mean 'text_field'?"),
    ({"data__name": "text_files", "data__options": {"paths": 3}}, "data.options.paths=3", "must be list or str"),
    ({"data__name": "text_files", "data__options": {"paths": ["a.txt", 7]}}, "data.options.paths holds 7 (int)",
     "items must be str"),
    ({"data__name": "embedded", "data__options": {"heldout_every": 2.5}}, "heldout_every", "must be int"),
]


@pytest.mark.parametrize("changes,key,hint", BAD_OPTIONS, ids=[k for _, k, _ in BAD_OPTIONS])
def test_bad_option_names_the_key_and_the_valid_ones(changes, key, hint):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(**changes))
    message = str(err.value)
    assert key in message and hint in message and "\n" not in message


@pytest.mark.parametrize("changes", [
    {"feature_map__name": "hedgehog", "feature_map__options": {"init_std": 1}},  # an int is a float
    {"loss__name": "l2", "loss__options": {"scale": "none"}},
    {"data__name": "text_files", "data__options": {"paths": "a.txt", "heldout_fraction": 0}},
    {"data__name": "wikipedia", "data__options": {"fraction": 0.5, "seed": 3}},
])
def test_good_options_pass(changes):
    validate_config(_cfg(**changes))


def test_options_are_read_from_the_signatures():
    from dofla.data import DATA_SOURCES
    from dofla.feature_maps import FEATURE_MAPS
    from dofla.options import FEATURE_MAP_PASSED, LOSS_PASSED, declared_options
    from dofla.train.losses import LOSSES

    prf = declared_options(FEATURE_MAPS.get("learned_prf"), FEATURE_MAP_PASSED)
    assert list(prf) == ["alpha_param"] and prf["alpha_param"].default == "log"
    assert prf["alpha_param"].types == (str,)
    assert list(declared_options(LOSSES.get("l2"), LOSS_PASSED)) == ["scale"]
    files = declared_options(DATA_SOURCES.get("text_files"), ())
    assert list(files) == ["paths", "text_field", "heldout_fraction", "on_bad_line"]
    assert files["paths"].types == (list, str) and files["heldout_fraction"].types == (float,)


def test_option_types_from_typing_annotations_defaults_and_kwargs():
    import typing

    from dofla.options import declared_options, option_problem

    def loose(size: int = 0, **extra):
        """Takes **extra: every name is accepted, so nothing can be checked."""

    assert declared_options(loose, ()) is None

    def strict(size: typing.Optional[int] = None, names: typing.List[str] = (), rate=0.5, blob: dict = None):
        """No **kwargs: the signature is the whole declaration."""

    strict.__annotations__ = {"size": typing.Optional[int], "names": typing.List[str], "blob": dict}
    declared = declared_options(strict, ())
    assert declared["size"].types == (int, type(None)) and declared["names"].types == (list,)
    assert declared["names"].item_types == (str,) and declared["size"].item_types == ()
    assert declared["rate"].types == (float,) and declared["blob"].types == ()
    assert option_problem("x", "it", declared, {"size": None, "names": ["a"], "rate": 1, "blob": [1]}) is None
    assert "x.size='3' must be int or null" in option_problem("x", "it", declared, {"size": "3"})
    assert "x.rate=[1] must be float" in option_problem("x", "it", declared, {"rate": [1]})
    assert "x.names holds 2 (int) but its items must be str" in option_problem("x", "it", declared, {"names": ["a", 2]})


def _stages(stages, **changes):
    from dofla.validate import stage_plan

    return stage_plan(_cfg(stages=stages, **changes))


def test_stage_plan_runs_dof_only_when_the_policy_needs_it_or_it_is_listed():
    configured = ["cache", "allocate", "train", "assemble", "distill", "finetune", "eval", "report"]  # conf/config.yaml
    on = [s for s in configured if s not in ("distill", "finetune")]  # off by their names (distill=none, finetune=none)
    assert _stages(configured) == ["cache", "dof", *on[1:]]
    assert _stages(configured, distill__name="kl") == ["cache", "dof", *[s for s in configured[1:] if s != "finetune"]]
    for policy in ("dof_clip", "dof_head", "fix_max"):
        assert "dof" in _stages(configured, allocation__policy=policy)
    assert _stages(configured, allocation__policy="fix") == on
    assert _stages(configured, allocation__policy="given", allocation__dims=[64] * 30) == on
    assert _stages(["cache", "dof", "allocate"], allocation__policy="fix") == ["cache", "dof", "allocate"]
    assert _stages(["allocate"], allocation__policy="fix") == ["allocate"]
    assert _stages(["allocate"]) == ["cache", "dof", "allocate"]
    assert _stages(["dof"], allocation__policy="fix") == ["cache", "dof"]
    assert _stages(["cache"]) == ["cache"]


@pytest.mark.parametrize("stages,needle", [
    (["eval"], "stages=['eval'] leaves out train, assemble, which the listed stages need; "
               "use stages=[cache,dof,allocate,train,assemble,eval]"),
    (["cache", "dof", "allocate", "assemble"], "leaves out train,"),
    (["train", "assemble", "report"], "leaves out eval,"),
    (["cache", "trian"], "unknown stage(s) trian; valid stages: cache, dof, allocate"),
])
def test_stage_plan_names_the_missing_or_unknown_stage(stages, needle):
    with pytest.raises(ConfigError) as err:
        _stages(stages)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_compiling_on_a_cpu_without_a_compiler_is_refused_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no g++, c++ or clang++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"train\.compile=true on the CPU needs a C\+\+ compiler"):
        validate_config(_cfg(train__compile=True, device="cpu"))
    monkeypatch.setenv("CXX", "/usr/bin/env")  # any executable named by $CXX counts
    validate_config(_cfg(train__compile=True, device="cpu"))


def test_a_gpu_the_machine_lacks_is_refused_before_loading():
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU
    with pytest.raises(ConfigError, match="CUDA GPU"):
        validate_config(_cfg(device=missing))
    validate_config(_cfg(device="cpu"))
    validate_config(_cfg(device="auto"))


@pytest.mark.skipif(__import__("torch").cuda.device_count() > 0, reason="needs a machine whose torch sees no GPU")
def test_a_slurm_job_given_gpus_that_torch_cannot_see_is_refused(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    with pytest.raises(ConfigError, match=r"SLURM job was given GPUs \(1\) but torch sees none .* or set device=cpu"):
        validate_config(_cfg(device="auto"))
    validate_config(_cfg(device="cpu"))  # asked for on purpose
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    validate_config(_cfg(device="auto"))  # a CPU job


def test_the_slurm_gpu_launcher_asks_for_a_gpu_a_day_and_requeues():
    from hydra import compose, initialize_config_dir

    from dofla.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert (launcher.gpus_per_node, launcher.timeout_min, launcher.max_num_timeout) == (1, 1440, 3)


@pytest.mark.parametrize("changes,source,needle", [
    ({"train__source": "stream", "train__batch_size": 3}, None, "train.batch_size=3 cannot be split evenly over 2"),
    ({"train__parallel": "data", "train__batch_size": 3}, "stream", "train.batch_size=3 cannot be split evenly"),
    ({"train__parallel": "data"}, "cache", "train.source=auto chose it"),
    ({"loss__name": "direct", "train__direct_batch_size": 3}, None, "train.direct_batch_size=3"),
    ({"distill__name": "kl", "distill__batch_size": 3}, "cache", "distill.batch_size=3 cannot be split evenly"),
])
def test_a_torchrun_split_that_cannot_work_is_one_sentence(changes, source, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        validate_world(_cfg(**changes), 2, source)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("changes,source", [
    ({"train__source": "stream", "train__batch_size": 4}, None),
    ({"train__batch_size": 3}, "cache"),  # auto on the cache splits the layers: any batch
    ({"train__source": "stream", "train__parallel": "layers", "train__batch_size": 3}, "stream"),
])
def test_a_torchrun_split_that_works_passes(changes, source):
    validate_world(_cfg(**changes), 2, source)
