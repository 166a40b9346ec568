"""The finetune stage (``finetune=lora``): a short LoRA fine-tune of the assembled student on
next-token loss -> ``student_finetuned/`` (merged weights), reused only for the same settings;
checkpointed (``finetune_ckpt.pt``), so a killed run resumes where it stopped."""
from __future__ import annotations

from pathlib import Path

from dofla.artifacts import model_dir_matches, save_model_dir
from dofla.config import RunConfig
from dofla.models import load_student
from dofla.record import write_json
from dofla.stages.context import RunContext, RunData
from dofla.stages.keys import finetune_settings
from dofla.stages.results import Finetuned
from dofla.stages.students import with_settings
from dofla.train.finetune import finetune_lora


def run(ctx: RunContext, student, data: RunData) -> Finetuned:
    """The fine-tuned student (or the stored one, for the same settings)."""
    return Finetuned(finetune(ctx.cfg, student, ctx.tokenizer, data.train_tokens, ctx.out_dir))


def finetune(cfg: RunConfig, student, tokenizer, train_tokens, out_dir: Path):
    """Optional LoRA fine-tune of the assembled student -> student_finetuned/ (merged weights),
    reused only when its ``dofla_settings.json`` matches (student's settings + fine-tune settings)."""
    target = out_dir / "student_finetuned"
    settings = finetune_settings(cfg, getattr(student, "dofla_settings", None))
    if model_dir_matches(target, settings):
        return with_settings(load_student(target).to(next(student.parameters()).device), settings)
    checkpoint = out_dir / "finetune_ckpt.pt"  # a killed fine-tune resumes from its last checkpoint
    curve = finetune_lora(student, train_tokens, cfg.finetune, seed=cfg.seed, precision=cfg.precision,
                          checkpoint_path=checkpoint, meta=settings)
    write_json(out_dir / "finetune_curve.json", curve)
    save_model_dir(student, tokenizer, target, settings)
    checkpoint.unlink(missing_ok=True)  # the student directory supersedes it
    return with_settings(student.eval(), settings)
