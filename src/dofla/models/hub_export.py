"""A saved student is what it says outside dofla: its own model type, remote code, a model card.

``save_pretrained`` on a student writes the teacher's weights and config as Hugging Face does;
:func:`export_student` then turns the directory into a dofla checkpoint:

- ``config.json`` gets ``model_type = "dofla_student"`` (the teacher's type moves to
  ``teacher_model_type``) and an ``auto_map`` naming two small files written beside it. Stock
  ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` runs them, and they hand
  over to :func:`dofla.models.load_student`, so the student loads, never its teacher. Without
  ``trust_remote_code`` transformers refuses (the type is unknown to it); without dofla installed
  the remote file fails with one sentence saying what to install.
- ``README.md``: a model card (teacher, attention form, feature map, dims per layer, and, once the
  run is evaluated, its distillation tokens and held-out metrics).

:func:`student_config` reads either form (directories saved before this kept the teacher's type
and a ``dofla`` entry), from a local directory or a hub repository.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

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


class DoflaStudentForCausalLM:
    """What ``auto_map`` names. Not a model itself: ``from_pretrained`` returns the real student
    (the teacher's own class with linear attention) built by :func:`load_student`."""

    config_class = DoflaStudentConfig

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """transformers registers the class it loaded; the student returned is not this class."""

    @classmethod
    def from_pretrained(cls, path, *args, config=None, **kwargs):
        from dofla.models.student import load_student

        for unused in ("trust_remote_code", "_from_auto", "adapter_kwargs", "_commit_hash"):
            kwargs.pop(unused, None)
        return load_student(path, *args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        """``AutoModelForCausalLM.from_config(config, trust_remote_code=True)``: an untrained student."""
        from transformers import AutoModelForCausalLM

        from dofla.models.student import student_class

        teacher_config = teacher_config_from_dict(config.to_dict(), "the config")
        base = AutoModelForCausalLM._model_mapping[type(teacher_config)]
        return student_class(base)._from_config(teacher_config, **kwargs)


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
    from transformers import AutoTokenizer

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
    from dofla.models.card import write_model_card

    write_model_card(directory)
