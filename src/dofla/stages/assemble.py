"""The assemble stage: the student as a Hugging Face model directory (``student/``), every layer's
trained features loaded, reused only when ``dofla_settings.json`` matches
(:func:`dofla.stages.keys.student_settings`)."""
from __future__ import annotations

import logging
from pathlib import Path

from dofla.artifacts import ArtifactError, artifact_problem, model_dir_matches, save_model_dir
from dofla.config import RunConfig
from dofla.faults import kill_point
from dofla.models import load_student
from dofla.stages.context import RunContext
from dofla.stages.keys import layer_meta, student_settings
from dofla.stages import softmax_layers
from dofla.stages.results import Assembled
from dofla.stages.students import (layer_dir, layer_dirs, layer_features, make_student, per_layer_meta, trainable,
                                   with_settings)
from dofla.train.layerwise import find_artifact

logger = logging.getLogger(__name__)


def run(ctx: RunContext, dims: list, cache_key: str, probe=None) -> Assembled:
    """The assembled student (in eval mode, on the teacher's device); ``probe``: training tokens
    (S, L) for ``allocation.softmax_layers``."""
    student = assemble(ctx.cfg, ctx.teacher, ctx.tokenizer, dims, ctx.out_dir, cache_key, probe)
    return Assembled(student, list((getattr(student.config, "dofla", None) or {}).get("softmax_layers") or []))


def assemble(cfg: RunConfig, teacher, tokenizer, dims, out_dir: Path, cache_key: str, probe=None):
    """The student as a Hugging Face model directory, with every layer's trained features and, with
    ``allocation.softmax_layers=k``, the k layers chosen on ``probe`` restored to softmax.

    ``student/`` is reused only when its ``dofla_settings.json`` matches these settings. Raises
    :class:`ArtifactError` when a layer with trainable features has no verified artifact.
    """
    target, settings = out_dir / "student", student_settings(cfg, cache_key, dims)
    if model_dir_matches(target, settings):  # loads on the CPU: join the teacher's device
        return with_settings(load_student(target).to(next(teacher.parameters()).device), settings)
    if (target / "config.json").exists():
        logger.warning(f"dofla: {target} was assembled for other settings; assembling it again")
    student = make_student(cfg, teacher, dims)
    student.config.dofla_run = run_provenance(cfg)  # for the model card
    kill_point("assemble")
    directories = layer_dirs(cfg, out_dir, settings["layers"])
    for i, attn in enumerate(student.student_attentions()):
        _load_trained_layer(i, attn, directories, layer_meta(cfg, cache_key), layer_dir(cfg, out_dir))
    if cfg.allocation.softmax_layers:
        softmax_layers.apply(cfg, student.eval(), teacher, probe, settings["layers"], directories[0], out_dir,
                             tokenizer)
    save_model_dir(student, tokenizer, target, settings)
    return with_settings(student.eval(), settings)


def run_provenance(cfg: RunConfig) -> dict:
    """How the student was made, in its config.json and model card."""
    return {"teacher": cfg.model.source, "revision": cfg.model.revision, "loss": cfg.loss.name,
            "allocation": cfg.allocation.policy, "seed": cfg.seed}


def _load_trained_layer(i: int, attn, directories: list[Path], meta: dict, base: Path) -> None:
    """Load layer ``i``'s verified features into ``attn``; a layer with nothing to train needs none."""
    features = layer_features(attn, "plan" in meta)  # a plan's layers as it trained them (GroupedFeatures)
    if features is None:
        return
    name, own_meta = f"layer_{i:02d}.pt", per_layer_meta(meta, i, attn)
    trained = find_artifact(directories, name, own_meta)
    if trained is not None:
        features.load_state_dict(trained["state_dict"])
    elif trainable(attn):
        problem = artifact_problem(directories[0] / name, own_meta)
        raise ArtifactError(
            f"layer {i} has no usable trained features ({directories[0] / name}: {problem}); train it by "
            f"running the same command with train.layers=[{i}] and train.layer_dir={base}, or run without "
            "train.layers to train every layer")

