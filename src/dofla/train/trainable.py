"""What the model-level stages train, chosen by name (``distill.train``): every layer's feature map
(``features``, with a hybrid's learned linear scale), the attention projections (``attention``),
low-rank adapters on them (``lora``, merged back by :func:`finish`) and a gated student's decay gates
(``gate``); everything else frozen."""
from __future__ import annotations

from torch import nn

from dofla.errors import DoflaError
from dofla.models.adapters.support import get_adapter

TRAINABLE = ("features", "attention", "lora", "gate")


def attention_projections(student) -> list[nn.Parameter]:
    """The parameters of every attention module except its linear-attention part (q/k/v/o, norms)."""
    params = []
    for module in get_adapter(student).attention_modules(student):
        params += [p for n, p in module.named_parameters() if not n.startswith("dofla.")]
    return params


def feature_parameters(student) -> list[nn.Parameter]:
    return [p for attn in student.student_attentions() if attn.feature_map is not None
            for p in attn.feature_map.parameters()]


def scale_parameters(student) -> list[nn.Parameter]:
    """Each hybrid layer's learned linear scale (``attention.linear_scale``), trained with the features."""
    return [attn.linear_log_scale for attn in student.student_attentions() if attn.linear_log_scale is not None]


def gate_parameters(student) -> list[nn.Parameter]:
    """The decay gates' parameters (``attention.gate``; none in an ungated student)."""
    return [p for attn in student.student_attentions() if getattr(attn, "gate", None) is not None
            for p in attn.gate.parameters()]


def prepare_trainable(student, train: list[str], lora_rank: int = 8, lora_alpha: int = 16):
    """Freeze ``student``, then unfreeze what ``train`` names; returns (the model to call, the Adam
    groups keyed ``features`` / ``attention`` / ``lora``). With ``lora`` the returned model is the
    peft wrapper (merge it with :func:`finish`)."""
    unknown = sorted(set(train) - set(TRAINABLE))
    if unknown or not train:
        raise DoflaError(f"distill.train={list(train)} names {', '.join(unknown) or 'nothing'}; "
                         f"choose from {', '.join(TRAINABLE)}")
    for p in student.parameters():
        p.requires_grad_(False)
    model, groups = student, []
    if "lora" in train:
        from peft import LoraConfig, get_peft_model  # lazy: peft (the lora extra), only for LoRA

        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                            target_modules=get_adapter(student).lora_targets,
                            fan_in_fan_out=student.config.model_type == "gpt2", bias="none")
        model = get_peft_model(student, config)
        groups.append(("lora", [p for p in model.parameters() if p.requires_grad]))
    if "attention" in train:
        groups.append(("attention", attention_projections(student)))
    if "features" in train:
        groups += [("features", feature_parameters(student)), ("scale", scale_parameters(student))]
    if "gate" in train:
        groups.append(("gate", gate_parameters(student)))
    groups = [(name, params) for name, params in groups if params]
    for _, params in groups:
        for p in params:
            p.requires_grad_(True)
    if not groups:
        raise DoflaError(f"distill.train={list(train)} leaves nothing to train in this student "
                         "(a training-free attention has no features); add attention or lora")
    return model, groups


def finish(model, student):
    """The student with LoRA merged (``model`` is the peft wrapper) or ``student`` itself, in eval mode."""
    if model is not student:
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
