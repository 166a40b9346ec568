"""Value checks of the ``eval`` section (:class:`~dofla.eval.config.EvalConfig`), beside it: one clear
sentence per bad value, before any model loads (:func:`validate_eval`, part of
:func:`dofla.validate.validate_config`) or once the model's context is known
(:func:`validate_eval_against_model`, part of :func:`dofla.validate.validate_against_model`)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from dofla.errors import require
from dofla.eval.suite import finetune_batch_sizes, finetune_micro_batch_sizes
from dofla.eval.task_data import train_data_problem
from dofla.value_checks import one_of, positive

if TYPE_CHECKING:  # the run's config is only read here; dofla.config composes this package's section
    from dofla.config import RunConfig


def validate_eval(cfg: RunConfig) -> None:
    """Every check of ``cfg.eval`` that needs no model."""
    ev = cfg.eval
    _validate_tasks(ev)
    _validate_probes(ev)
    _validate_agreement(cfg)


def _validate_tasks(ev) -> None:
    one_of("eval.protocol", ev.protocol, ("zeroshot", "finetune"))
    require(all(isinstance(t, str) and t for t in ev.tasks),
            f"eval.tasks={list(ev.tasks)!r} must be a list of lm-eval task names")
    require(ev.protocol == "zeroshot" or ev.tasks,
            "eval.protocol=finetune needs tasks to fine-tune on; set eval.tasks=[...] or eval=downstream7")
    if ev.task_limit is not None:
        positive("eval.task_limit", ev.task_limit)
    if ev.finetune_train_limit is not None:
        positive("eval.finetune_train_limit", ev.finetune_train_limit)
    require(len(ev.finetune_lr_grid) > 0, "eval.finetune_lr_grid is empty; give at least one learning rate")
    for key, value in [("eval.task_batch_size", ev.task_batch_size), ("eval.finetune_epochs", ev.finetune_epochs),
                       ("eval.finetune_max_length", ev.finetune_max_length),
                       *(("eval.finetune_lr_grid entry", lr) for lr in ev.finetune_lr_grid),
                       *((f"eval.finetune_batch_size.{t}", n) for t, n in finetune_batch_sizes(ev).items())]:
        positive(key, value)
    micro = finetune_micro_batch_sizes(ev)
    require(all(m is None or m == "auto" or (isinstance(m, int) and m > 0) for m in micro.values()),
            f"eval.finetune_micro_batch_size={ev.finetune_micro_batch_size} must be null (the whole batch), auto, "
            "a positive number or {task: n, default: n}")
    positive("eval.finetune_log_every", ev.finetune_log_every)
    require(ev.finetune_checkpoint_every >= 0,
            f"eval.finetune_checkpoint_every={ev.finetune_checkpoint_every} must be ≥ 0 (0: at epoch ends only)")
    require((problem := train_data_problem(ev.finetune_train_data)) is None, problem or "")
    for folder in ev.task_dirs:
        require(Path(folder).expanduser().is_dir(),
                f"eval.task_dirs entry {folder} is not a directory; point it at a folder of lm-eval task YAMLs")


def _validate_probes(ev) -> None:
    require(list(ev.position_buckets) == sorted(set(ev.position_buckets)) and all(b >= 1 for b in ev.position_buckets),
            f"eval.position_buckets={list(ev.position_buckets)} must be increasing positions ≥ 1")
    require(all(isinstance(n, int) and n >= 64 for n in ev.passkey_lengths),
            f"eval.passkey_lengths={list(ev.passkey_lengths)} must be context lengths of at least 64 tokens")
    if ev.mqar:
        positive("eval.mqar_examples", ev.mqar_examples)
        require(len(ev.mqar_seq_lens) > 0 and all(isinstance(t, int) and t >= 8 for t in ev.mqar_seq_lens),
                f"eval.mqar_seq_lens={list(ev.mqar_seq_lens)} must be sequence lengths of at least 8 tokens")


def agreement_prompts_available(cfg: RunConfig) -> int:
    """How many agreement prompts the held-out text gives: each of its ``data.seq_len`` sequences cut
    into pieces of ``eval.agreement_prompt_len`` tokens (:func:`dofla.eval.agreement.agreement_prompts`)."""
    sequences = math.ceil(cfg.data.heldout_tokens / cfg.data.seq_len)
    return sequences * (cfg.data.seq_len // cfg.eval.agreement_prompt_len)


def _validate_agreement(cfg: RunConfig) -> None:
    ev = cfg.eval
    require(isinstance(ev.agreement_prompts, int) and not isinstance(ev.agreement_prompts, bool)
            and ev.agreement_prompts >= 0,
            f"eval.agreement_prompts={ev.agreement_prompts!r} must be 0 (off) or a number of held-out prompts")
    if not ev.agreement_prompts:
        return
    positive("eval.agreement_prompt_len", ev.agreement_prompt_len)
    positive("eval.agreement_tokens", ev.agreement_tokens)
    available = agreement_prompts_available(cfg)
    require(ev.agreement_prompts <= available,
            f"eval.agreement_prompts={ev.agreement_prompts} asks for more prompts of eval.agreement_prompt_len="
            f"{ev.agreement_prompt_len} tokens than the held-out text gives ({available}); ask for fewer, shorten "
            "the prompts, or raise data.heldout_tokens")


def validate_eval_against_model(cfg: RunConfig, max_positions: int) -> None:
    """The eval checks that need the model's context of ``max_positions`` tokens."""
    ev = cfg.eval
    long = ev.long_seq_len or cfg.data.seq_len
    require(long <= max_positions, f"eval.long_seq_len={long} exceeds the model's context of {max_positions} tokens")
    require(not ev.position_buckets or ev.position_buckets[-1] <= long,
            f"eval.position_buckets={list(ev.position_buckets)} reach past eval.long_seq_len={long}")
    require(all(n <= max_positions for n in ev.passkey_lengths),
            f"eval.passkey_lengths={list(ev.passkey_lengths)} exceed the model's context of {max_positions} tokens")
    if ev.agreement_prompts:
        total = ev.agreement_prompt_len + ev.agreement_tokens
        require(total <= max_positions,
                f"eval.agreement_prompt_len + eval.agreement_tokens = {total} tokens exceed the model's context of "
                f"{max_positions} tokens; shorten the prompts or the continuations")
