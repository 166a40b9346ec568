"""The training sections of a run: ``loss``, ``train`` (the layerwise or direct stage, on
:class:`StepConfig`), ``distill`` (KL to the teacher) and ``finetune`` (LoRA), beside their trainers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional

from dofla.section_keys import Keys


@dataclass
class LossConfig:
    name: str = "softmax"  # l2 | softmax | output, or direct (the direct training mode, dofla.stages.plan)
    options: dict[str, Any] = field(default_factory=dict)

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options"))


@dataclass
class StepConfig:
    """How a set of feature maps is optimised: shared by the run's ``train`` group (TrainConfig) and
    the trainers' own config (dofla.train.LayerTrainConfig), declared once here."""

    steps: int = 150
    batch_size: int = 2
    lr_z: float = 0.02
    lr_alpha: float = 0.2
    lr_other: float = 1e-2
    warmup_steps: int = 10
    schedule: str = "constant"  # constant | cosine (after warm-up)
    heldout_fraction: float = 0.1
    eval_every: int = 25
    patience: int = 0  # evaluations without improvement before stopping; 0 = never stop early
    checkpoint_every: int = 50
    log_every: int = 10  # live curves: losses, tokens/s and ETA to the tracker (one host sync) this often
    skip_nonfinite: bool = False
    # sequences per forward/backward, gradients accumulated to the full batch's (None: all at once):
    # lowers the peak memory, not the result; auto: the largest that fits (dofla.train.capacity)
    micro_batch_size: Any = None


# Training settings that change how a step runs, not what it learns: out of the artifact keys
# (dofla.stages.keys) and of stream checkpoints, which a requeued job resumes across them
NOT_LEARNT = ("checkpoint_every", "log_every", "micro_batch_size", "compile")


@dataclass
class TrainConfig(StepConfig):
    layers: Optional[list[int]] = None  # None = all layers; a subset trains only those
    layer_dir: Optional[str] = None  # layer artifacts (None: <run>/layers); share it across parallel jobs
    direct_batch_size: int = 1
    # where training reads its data: cache (all of data.num_tokens on disk; direct: train.steps random rows),
    # stream (one pass over data.num_tokens of fresh text: layerwise runs a teacher forward per step, direct a
    # student forward), auto (stream when caching every token's activations would exceed cache_limit_gb)
    source: str = "auto"
    cache_limit_gb: float = 4.0
    max_steps: Optional[int] = None  # stream: stop after this many steps even if tokens remain
    # dtype of the teacher forwards that produce distillation activations (the cache and the stream):
    # bfloat16 / float16 halve a GPU's teacher time; evaluation always runs the fp32 teacher
    teacher_dtype: str = "float32"
    # before training: predict the stage's peak memory from a trace of its step, print it, refuse a micro-batch
    # that cannot fit (micro_batch_size=auto always runs it); memory_limit_gb: plan against it, not the device
    preflight: bool = True
    memory_limit_gb: Optional[float] = None
    # under torchrun, how the ranks share layerwise training: data (every rank runs the teacher and the losses
    # on its share of each batch, gradients averaged; train.batch_size is the batch over all of them), layers
    # (layer i on rank i mod N: each rank holds only its layers), auto (data when streaming, layers from cache)
    parallel: str = "auto"
    # what a hybrid layer's features learn from in the layerwise stage: hybrid (the layer's own
    # output: exact window and sinks, linear before) or full (the linear part alone against the
    # teacher's full attention, as a pure-linear layer; such layers are shared with linear runs)
    hybrid_target: str = "hybrid"
    # torch.compile the layer loss (one graph for every layer of a shape; the first steps pay the
    # compilation, on the CPU that needs a C++ compiler). Changes the speed, not what is learned
    compile: bool = False

    # which job trains a layer, where it writes, how often it checkpoints: not what it learns
    KEYS: ClassVar[Keys] = Keys(
        in_key=("steps", "batch_size", "lr_z", "lr_alpha", "lr_other", "warmup_steps", "schedule", "heldout_fraction",
                "eval_every", "patience", "skip_nonfinite", "direct_batch_size", "source", "max_steps",
                "teacher_dtype", "hybrid_target"),
        out=("layers", "layer_dir", "cache_limit_gb", "preflight", "memory_limit_gb", "parallel", *NOT_LEARNT),
        legacy={"teacher_dtype": "float32", "micro_batch_size": None, "hybrid_target": "hybrid"})


@dataclass
class FinetuneConfig:
    """Optional LoRA fine-tune of the attention projections after assemble (off by default)."""

    name: str = "none"  # none | lora
    steps: int = 40
    batch_size: int = 1
    lr: float = 2e-4
    rank: int = 8
    alpha: int = 16
    warmup_steps: int = 5

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "steps", "batch_size", "lr", "rank", "alpha", "warmup_steps"))


@dataclass
class DistillConfig:
    """Model-level distillation after assemble (``distill=kl``): KL(teacher ‖ student) on the next-token
    distributions of fresh streamed text, training what ``train`` names (off by default)."""

    name: str = "none"  # none | kl
    tokens: int = 65536  # distillation tokens (one pass over fresh text)
    # times the KL text may be read: a stage asked for more tokens than the training split holds after the
    # layerwise stage's reads its own text again, each pass in another order (prepared tokens only)
    passes: int = 1
    seq_len: Optional[int] = None  # None: data.seq_len
    batch_size: int = 4  # effective batch (sequences per optimiser step)
    micro_batch_size: Any = None  # sequences per forward/backward (None: batch_size; auto: what fits)
    logit_chunk: int = 0  # positions per LM-head chunk of the KL (0: whole; dofla.train.logit_chunks)
    train: List[str] = field(default_factory=lambda: ["features", "attention"])  # features | attention | lora
    lr: float = 1e-4  # attention projections, LoRA
    feature_lr: float = 1e-3  # feature maps
    scale_lr: float = 0.1  # a hybrid's learned linear scale (attention.linear_scale: a log scale, moves by O(1))
    temperature: float = 1.0
    warmup_steps: int = 10
    schedule: str = "cosine"  # constant | cosine (to 10 % of the peak)
    grad_clip: float = 1.0  # 0: no clipping (and no non-finite guard)
    offset: Optional[int] = None  # text tokens skipped first (None: those the layerwise stage read)
    lora_rank: int = 8
    lora_alpha: int = 16
    # hybrid students: the probability that a layer runs without its exact window and sinks for a step (pure
    # linear, so its linear part must carry every key); moves linearly to window_dropout_end when that is set
    window_dropout: float = 0.0
    window_dropout_end: Optional[float] = None
    copy_share: float = 0.0  # far copies (dofla.data.copies): share of KL tokens that repeat earlier spans
    copy_distance: int = 128  # tokens from a span to its copy, at least
    # the teacher's targets: 0 its whole next-token distribution, k > 0 its top k and the rest's mass (the KL
    # over k + 1 buckets, dofla.train.kl_targets); stored once per text when teacher_cache=auto, within
    # teacher_cache_gb for every text and teacher together (dofla.cache.teacher_logits)
    teacher_topk: int = 0
    teacher_cache: str = "auto"  # auto | off
    teacher_cache_gb: float = 20.0
    checkpoint_every: int = 50
    log_every: int = 10

    # micro-batching changes the peak memory, not the gradient; neither does torchrun's split
    KEYS: ClassVar[Keys] = Keys(
        in_key=("name", "tokens", "passes", "seq_len", "batch_size", "train", "lr", "feature_lr", "scale_lr", "temperature",
                "warmup_steps", "schedule", "grad_clip", "offset", "lora_rank", "lora_alpha", "window_dropout",
                "window_dropout_end", "copy_share", "copy_distance", "teacher_topk"),
        # the teacher-logit cache stores the targets the teacher would give (bit for bit): not what is learnt
        out=("micro_batch_size", "logit_chunk", "checkpoint_every", "log_every", "teacher_cache", "teacher_cache_gb"),
        legacy={"window_dropout": 0.0, "window_dropout_end": None, "logit_chunk": 0, "scale_lr": 0.1, "copy_share": 0.0,
                "copy_distance": 128, "teacher_topk": 0, "passes": 1})
