"""Attention kernels: quadratic references (naive) and the linear-time forms (chunked, recurrent)."""
from dofla.attention.delta import (
    DeltaState,
    delta_rule_chunked,
    delta_rule_naive,
    delta_rule_recurrent,
    unit_features,
)
from dofla.attention.delta_backend import delta_rule
from dofla.attention.hybrid import HybridState, hybrid_attention_chunked, hybrid_attention_naive
from dofla.attention.linear import LinearState, linear_attention_chunked, linear_attention_recurrent
from dofla.attention.naive import (
    kernel_matrix,
    linear_attention_naive,
    log_kernel_matrix,
    masked_softmax,
    softmax_attention,
)
from dofla.attention.stable import causal_log_kernel, stable_block

from dofla.attention.forms import FORMS, AttentionForm, form_for, get_form, register, selectable

# What replaces softmax in a student's global layers (dofla.models.convert, config attention.name): the
# registered forms a config may name (dofla.attention.forms)
ATTENTION_FORMS = selectable()

__all__ = [
    "ATTENTION_FORMS",
    "AttentionForm",
    "FORMS",
    "form_for",
    "get_form",
    "register",
    "DeltaState",
    "delta_rule",
    "delta_rule_chunked",
    "delta_rule_naive",
    "delta_rule_recurrent",
    "HybridState",
    "hybrid_attention_chunked",
    "hybrid_attention_naive",
    "LinearState",
    "kernel_matrix",
    "linear_attention_chunked",
    "linear_attention_naive",
    "linear_attention_recurrent",
    "log_kernel_matrix",
    "masked_softmax",
    "causal_log_kernel",
    "stable_block",
    "softmax_attention",
    "unit_features",
]
