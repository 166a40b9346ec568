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
  run is evaluated, its distillation tokens and held-out metrics), its front matter
  ``huggingface_hub.ModelCardData``: the scores as ``model-index`` entries, the teacher's licence
  (:mod:`dofla.models.card`).

:func:`student_config` reads either form (directories saved before this kept the teacher's type
and a ``dofla`` entry), from a local directory or a hub repository.
"""
from __future__ import annotations

from transformers import AutoModelForCausalLM

# the exported form's names, imported from here by saved students' remote-code files and by callers
from dofla.models.export_format import (  # noqa: F401
    AUTO_MAP, CONFIG_FILE, INSTALL_HINT, MODELING_FILE, REMOTE_FILES, STUDENT_MODEL_TYPE, DoflaStudentConfig,
    export_student, load_student_tokenizer, student_config, teacher_config_dict, teacher_config_from_dict,
)
from dofla.models.student import load_student, student_class


class DoflaStudentForCausalLM:
    """What ``auto_map`` names. Not a model itself: ``from_pretrained`` returns the real student
    (the teacher's own class with linear attention) built by :func:`load_student`."""

    config_class = DoflaStudentConfig

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """transformers registers the class it loaded; the student returned is not this class."""

    @classmethod
    def from_pretrained(cls, path, *args, config=None, **kwargs):
        for unused in ("trust_remote_code", "_from_auto", "adapter_kwargs", "_commit_hash"):
            kwargs.pop(unused, None)
        return load_student(path, *args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        """``AutoModelForCausalLM.from_config(config, trust_remote_code=True)``: an untrained student."""
        teacher_config = teacher_config_from_dict(config.to_dict(), "the config")
        base = AutoModelForCausalLM._model_mapping[type(teacher_config)]
        return student_class(base)._from_config(teacher_config, **kwargs)
