"""Typed run configuration: what Hydra composes from conf/, converted with ``OmegaConf.to_object``.

Library code takes these dataclasses (or plain values), never a DictConfig, so every stage can be
called from a notebook: ``pipeline.run(RunConfig(...), out_dir)``. Each section's dataclass lives
beside what reads it and declares, beside its fields, how they enter the artifact keys (``KEYS``,
:class:`~dofla.section_keys.Keys`): a new option is one field and its name in that declaration, in
one file. :class:`RunConfig` composes the sections with the run's own settings:

    model                      dofla.models.config        ModelConfig
    data                       dofla.data.config          DataConfig
    feature_map                dofla.feature_maps.config  FeatureMapConfig
    attention                  dofla.attention.config     AttentionConfig
    allocation, budget         dofla.dof.config           AllocationConfig, BudgetConfig
    loss, train, distill,      dofla.train.config         LossConfig, TrainConfig (on StepConfig),
    finetune                                              DistillConfig, FinetuneConfig
    eval                       dofla.eval.config          EvalConfig
    logger, paths, the run's   here                       LoggerConfig (read by dofla.tracking),
    own fields                                            PathsConfig, RunConfig
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from dofla.attention.config import AttentionConfig
from dofla.data.config import DataConfig
from dofla.dof.config import AllocationConfig, BudgetConfig
from dofla.eval.config import EvalConfig
from dofla.feature_maps.config import FeatureMapConfig
from dofla.models.config import ModelConfig
from dofla.section_keys import Keys
from dofla.train.config import NOT_LEARNT, DistillConfig, FinetuneConfig, LossConfig, StepConfig, TrainConfig

__all__ = ["ADDED_SECTIONS", "LEGACY_VALUES", "NOT_LEARNT", "AllocationConfig", "AttentionConfig", "BudgetConfig",
           "DataConfig", "DistillConfig", "EvalConfig", "FeatureMapConfig", "FinetuneConfig", "Keys", "LoggerConfig",
           "LossConfig", "ModelConfig", "PathsConfig", "RunConfig", "StepConfig", "TrainConfig", "section_keys"]


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "dofla"
    group: Optional[str] = None
    mode: Optional[str] = None  # wandb mode: online | offline | disabled


@dataclass
class PathsConfig:
    # activation caches, prepared data and teacher scores (None: DOFLA_CACHE_DIR or the user cache)
    cache_dir: Optional[str] = None
    outputs_dir: str = "outputs"  # single runs: <outputs_dir>/<date>/<time>
    sweeps_dir: str = "multirun_sweeps"  # -m sweeps: <sweeps_dir>/<date>/<time>/<job number>


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    feature_map: FeatureMapConfig = field(default_factory=FeatureMapConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    paths: PathsConfig = field(default_factory=PathsConfig)
    # where the teacher, student and feature maps run: auto (the GPU when one is visible, under
    # torchrun this rank's), cpu, cuda or cuda:N; data and caches stay in host memory
    device: str = "auto"
    # training arithmetic: fp32 | tf32 (CUDA matmuls) | bf16 (autocast, fp32 master weights; dofla.precision);
    # auto: tf32 where the run's device is a GPU, else fp32 (resolved before anything loads)
    precision: str = "fp32"
    # dof runs when the allocation policy needs it (dofla.validate.stage_plan); list it to run Algorithm 1 under fix
    stages: list[str] = field(default_factory=lambda: ["cache", "allocate", "train", "assemble", "distill", "finetune",
                                                       "eval", "report"])
    experiment: Optional[str] = None

    KEYS: ClassVar[Keys] = Keys(legacy={"precision": "fp32"})


def section_keys() -> dict[str, Keys]:
    """Each section's key declaration by its name in RunConfig (none: no key reads it); ``run`` for
    RunConfig's own fields."""
    sections = {f.name: f.default_factory for f in fields(RunConfig) if isinstance(f.default_factory, type)}
    return {"run": RunConfig.KEYS, **{name: getattr(cls, "KEYS", Keys()) for name, cls in sections.items()}}


# Settings added after artifacts and runs were recorded without them, with the value that reproduces
# what those did (each section's Keys.legacy): a setting at this value is left out of the artifact
# key it belongs to (so older artifacts stay valid, dofla.stages.keys) and filled in when older runs
# are compared (dofla.report).
LEGACY_VALUES: dict[tuple[str, str], Any] = {(name, key): value for name, keys in section_keys().items()
                                             for key, value in keys.legacy.items()}
# Config sections added later: a run recorded without one ran with its defaults.
ADDED_SECTIONS: dict[str, type] = {"distill": DistillConfig, "paths": PathsConfig}
