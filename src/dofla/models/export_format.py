"""The exported form of a saved student: ``config.json`` with ``model_type = "dofla_student"`` and an
``auto_map`` naming two small remote-code files, both forms of its config read back, and the
rewrite of a freshly saved directory into that form (:func:`export_student`). The class those files
hand over to, :class:`dofla.models.hub_export.DoflaStudentForCausalLM`, sits above the student
module; this one sits below it, so the student can export itself.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dofla.models.card import write_model_card

STUDENT_MODEL_TYPE = "dofla_student"
CONFIG_FILE, MODELING_FILE = "configuration_dofla.py", "modeling_dofla.py"
AUTO_MAP = {"AutoConfig": "configuration_dofla.DoflaStudentConfig",
            "AutoModelForCausalLM": "modeling_dofla.DoflaStudentForCausalLM"}
INSTALL_HINT = ("this model is a dofla linear-attention student and its code is the dofla package: install "
                "dofla (pip install <dofla checkout or wheel>) in this environment to load it")

# The remote-code files only import dofla; the import sits in a try block so that transformers'
# import check does not pre-empt the sentence below with a "pip install dofla" that would not work.
REMOTE_FILES = {
    CONFIG_FILE: f'''"""Configuration of a dofla student: the code lives in the dofla package."""
try:
    from dofla.models.hub_export import DoflaStudentConfig
except ImportError as error:
    raise ImportError({INSTALL_HINT!r}) from error

__all__ = ["DoflaStudentConfig"]
''',
    MODELING_FILE: f'''"""Model of a dofla student: the code lives in the dofla package."""
try:
    from dofla.models.hub_export import DoflaStudentConfig, DoflaStudentForCausalLM
except ImportError as error:
    raise ImportError({INSTALL_HINT!r}) from error

__all__ = ["DoflaStudentConfig", "DoflaStudentForCausalLM"]
''',
}


class DoflaStudentConfig(PretrainedConfig):
    """The exported config.json as transformers sees it with ``trust_remote_code``: the teacher's
    fields (flat, so tools reading e.g. ``max_position_embeddings`` work) plus ``dofla``."""

    model_type = STUDENT_MODEL_TYPE


def teacher_config_dict(raw: dict) -> dict:
    """config.json of a student (either form) -> the teacher's config dict with ``dofla``."""
    raw = dict(raw)
    if raw.get("model_type") == STUDENT_MODEL_TYPE:
        raw["model_type"] = raw.pop("teacher_model_type")
        raw["architectures"] = raw.pop("teacher_architectures", None)
        raw.pop("auto_map", None)
    return raw


def student_config(path: str | Path, **hub_kwargs) -> PretrainedConfig:
    """The teacher-class config (with ``config.dofla``) of the student saved at ``path``."""
    raw, _ = PretrainedConfig.get_config_dict(str(path), **hub_kwargs)
    return teacher_config_from_dict(raw, path)


def load_student_tokenizer(path: str | Path, **hub_kwargs):
    """The tokenizer saved with a student. Given the student's own (teacher-class) config, so that
    ``AutoTokenizer`` does not read ``model_type = "dofla_student"`` and stop to ask whether to run
    remote code."""
    return AutoTokenizer.from_pretrained(path, config=student_config(path, **hub_kwargs), **hub_kwargs)


def teacher_config_from_dict(raw: dict, where) -> PretrainedConfig:
    """A student's config dict (either form) -> the teacher's config class, with ``dofla``."""
    raw = teacher_config_dict(raw)
    if raw.get("dofla") is None:
        raise ValueError(f"{where} holds no dofla student (config.json has no 'dofla' entry)")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where} is a student of a {model_type!r} model, which this transformers does not "
                         "know; install a transformers release that has it")
    return CONFIG_MAPPING[model_type].from_dict(raw)


def export_student(directory: str | Path) -> None:
    """Rewrite a freshly saved student directory into the exported form (see the module docstring)."""
    directory = Path(directory)
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    if raw.get("model_type") != STUDENT_MODEL_TYPE:
        raw["teacher_model_type"] = raw["model_type"]
        raw["teacher_architectures"] = [a.removeprefix("Linear") for a in raw.get("architectures") or []]
    raw.update(model_type=STUDENT_MODEL_TYPE, auto_map=AUTO_MAP, architectures=["DoflaStudentForCausalLM"])
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for name, text in REMOTE_FILES.items():
        (directory / name).write_text(text)
    write_model_card(directory)
