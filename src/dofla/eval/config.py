"""The ``eval`` section of a run: what the evaluation measures (:mod:`dofla.eval`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional

from dofla.section_keys import Keys


@dataclass
class EvalConfig:
    name: str = "default"
    batch_size: int = 2
    attn_error_seqs: int = 2
    perplexity: bool = True
    attention_error: bool = True
    # lm-eval tasks, zero-shot on teacher and student (mmlu_dev_offline is built locally from
    # lm-eval's own files; downstream7 lists the paper's seven). Unavailable data is skipped.
    tasks: List[str] = field(default_factory=list)
    task_limit: Optional[int] = None  # first N documents of each task (None: all)
    task_batch_size: int = 8
    task_dirs: List[str] = field(default_factory=list)  # extra lm-eval task YAML folders
    protocol: str = "zeroshot"  # zeroshot | finetune (the paper's per-task fine-tune, METHOD §5)
    finetune_lr_grid: List[float] = field(default_factory=lambda: [1e-5, 3e-5, 1e-4])
    finetune_epochs: int = 3
    # sequences per fine-tune step: a number, or per task {task: n, default: n}
    finetune_batch_size: Any = 4
    finetune_max_length: int = 512  # tokens per fine-tune example (the oldest context is cut first)
    finetune_train_limit: Optional[int] = None  # first N training documents per task
    # training data for tasks lm-eval defines no training split for, per task: a hub dataset
    # ({path, name, split}) or local JSON lines ({files: [...]}), rows shaped like the task's docs;
    # eval=downstream7 sets MMLU's: cais/mmlu auxiliary_train, as the paper fine-tunes it
    finetune_train_data: Any = None
    # sequences per fine-tune forward, gradients accumulated over finetune_batch_size: null (the whole
    # batch), a number, per task {task: n, default: n}, or auto (the memory preflight picks the largest that fits)
    finetune_micro_batch_size: Any = None
    finetune_checkpoint_every: int = 0  # fine-tune steps between checkpoints inside an epoch (0: at epoch ends only)
    finetune_log_every: int = 20  # fine-tune losses reach the host (one synchronisation) this often
    mqar: bool = False  # multi-query associative recall: accuracy vs sequence length
    mqar_seq_lens: List[int] = field(default_factory=lambda: [64, 128, 256])
    mqar_examples: int = 16
    ablate_linear: bool = False  # also evaluate a hybrid student with its linear part removed
    window_mass: bool = False  # teacher's attention mass outside window + sinks, per layer
    position_buckets: List[int] = field(default_factory=list)  # loss by position: bucket edges
    long_context_seqs: int = 2  # sequences of data.long_seq_len for loss by position
    long_seq_len: Optional[int] = None  # None: data.seq_len
    passkey_lengths: List[int] = field(default_factory=list)  # passkey probe lengths: accuracy and answer NLL
    passkey_trials: int = 4
    memory_contexts: List[int] = field(default_factory=list)  # decode memory per sequence at these context lengths
    passkey_seed: Optional[int] = None  # seed of the passkey prompts (None: the run's seed); fixed: the same prompts in every run

    # each measurement's key is built field by field (dofla.stages.eval)
    KEYS: ClassVar[Keys] = Keys(legacy={"finetune_batch_size": 4, "finetune_max_length": 512,
                                        "finetune_train_data": None, "finetune_micro_batch_size": None,
                                        "finetune_checkpoint_every": 0, "finetune_log_every": 1})
