"""dofla: distil softmax attention into linear attention with DoF-chosen feature dimensions."""
from dofla.models import convert, load_student, load_teacher

__all__ = ["convert", "load_student", "load_teacher"]
__version__ = "0.1.0"
