from dofla.models.adapters import (
    ADAPTERS,
    AttentionGeometry,
    UnsupportedModelError,
    check_supported,
    get_adapter,
)
from dofla.models.capture import capture_qkv, capturing
from dofla.models.hub_export import load_student_tokenizer
from dofla.models.loading import EMBEDDED, ModelLoadError, cache_root, load_teacher, load_tokenizer
from dofla.models.plan import HeadPlan, StudentPlan, expand
from dofla.models.restore import restorable_layers, restore_softmax, softmax_restored
from dofla.models.spec import ConversionSpec
from dofla.models.student import convert, load_student, student_class
from dofla.models.recurrent_cache import RecurrentStateCache
from dofla.models.student_attention import StudentAttention

__all__ = [
    "ADAPTERS", "AttentionGeometry", "UnsupportedModelError", "check_supported", "get_adapter", "capture_qkv",
    "capturing", "EMBEDDED", "ModelLoadError", "cache_root", "load_teacher", "load_tokenizer", "ConversionSpec", "convert",
    "load_student", "load_student_tokenizer", "restorable_layers", "restore_softmax", "softmax_restored", "student_class", "RecurrentStateCache", "StudentAttention",
    "HeadPlan", "StudentPlan", "expand",
]
