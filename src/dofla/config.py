"""Typed run configuration: what Hydra composes from conf/, converted with ``OmegaConf.to_object``.

Library code takes these dataclasses (or plain values), never a DictConfig, so every stage can be
called from a notebook: ``pipeline.run(RunConfig(...), out_dir)``. Each section declares, beside
its fields, how they enter the artifact keys (``KEYS``, :class:`Keys`): a new option is one field
and its name in that declaration.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, List, Optional


@dataclass(frozen=True)
class Keys:
    """How a section's fields enter the artifact keys (:mod:`dofla.stages.keys`): ``in_key`` change what
    an artifact holds, ``out`` do not (how or where a job runs); a field in neither fails loudly once a
    key reads the section. ``legacy``: fields added after artifacts were written, at the value that
    reproduces those; a field at it is left out of its key, so older artifacts stay valid."""

    in_key: tuple[str, ...] = ()
    out: tuple[str, ...] = ()
    legacy: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    source: str = "embedded:smollm2-135m-instruct"  # hub id, local dir, embedded:..., tiny:<arch>
    revision: Optional[str] = None
    tiny_layers: int = 2  # only for tiny:<arch> sources

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "source", "revision", "tiny_layers"))


@dataclass
class DataConfig:
    name: str = "embedded"
    options: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 512
    # distillation tokens (cached, or streamed once with train.source=stream); "all": one pass over
    # the prepared training split (dofla-prepare), minus the cached sample and distill.tokens
    num_tokens: Any = 8192
    # tokens whose activations are cached when training streams: Algorithm 1's sample and the
    # held-out set of the layerwise trainer (None: min(num_tokens, 8192)); the cache path caches all
    cache_tokens: Optional[int] = None
    prefetch: int = 2  # batches a thread reads ahead of the step (0: none); same batches (dofla.data.prefetch)
    heldout_tokens: int = 4096  # for held-out perplexity and attention error
    # dofla-prepare's tokens for this data and tokenizer: auto (when they exist), require, off (tokenise)
    prepared: str = "auto"
    # None: the training split in its own order; a seed: its sequences in that seed's random order
    # (prepared data only): the cached sample is a random sample of the split, the stream the rest
    shuffle_seed: Optional[int] = None

    # prepared tokens are the text path's tokens, read faster; prefetching changes no batch
    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options", "seq_len", "num_tokens", "cache_tokens", "heldout_tokens",
                                        "shuffle_seed"), out=("prepared", "prefetch"), legacy={"shuffle_seed": None})


@dataclass
class FeatureMapConfig:
    name: str = "learned_prf"
    options: dict[str, Any] = field(default_factory=dict)

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options"))


@dataclass
class AttentionConfig:
    name: str = "linear"
    window: int = 0  # > 0: exact softmax over the last `window` tokens, linear attention before
    sinks: int = 0  # exact softmax also over the first `sinks` tokens (hybrid, sliding_window)
    chunk_size: Any = 128  # linear kernel's chunk (128: fastest here); auto: timed once per machine
    gate: str = "none"  # none | scalar (linear, hybrid: a per-head decay of the linear state, trained by distill=kl)
    linear_scale: str = "fixed"  # fixed | learned (hybrid: a per-head weight of the linear part, trained by distill=kl)

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "window", "sinks", "chunk_size", "gate", "linear_scale"),
                                legacy={"sinks": 0, "gate": "none", "linear_scale": "fixed"})


@dataclass
class LossConfig:
    name: str = "softmax"  # l2 | softmax | output, or direct (the direct training mode, dofla.stages.plan)
    options: dict[str, Any] = field(default_factory=dict)

    KEYS: ClassVar[Keys] = Keys(in_key=("name", "options"))


@dataclass
class AllocationConfig:
    policy: str = "dof"  # fix | dof | dof_clip | dof_head | fix_max | measured
    lam: float = 1e-2
    num_samples: int = 512  # J, vectors per head for Algorithm 1 (the paper does not state its J)
    gram_norm: str = "trace"  # none | J | trace (docs/method.md §4)
    num_tokens: Optional[int] = None  # tokens of the cache used to pool q∪k (None: all)
    head_aggregate: str = "mean"  # a layer's DoF from its heads: mean (steadiest) | max (the paper's) | median
    resamples: int = 16  # J-samples averaged per head (1: the paper's single sample)
    spread_samples: int = 0  # > 0: also estimate each layer's DoF on this many other J-samples (spread)
    measured_dims: List[int] = field(default_factory=lambda: [16, 64, 256])  # measured: M grid per layer
    measured_steps: int = 60  # measured: training steps per (layer, M) point
    head_quantum: int = 8  # dof_head: per-head dims are multiples of this (heads of equal dim share a block)
    head_blocks: int = 2  # dof_head: at most this many blocks (distinct dims) per layer; 0 = no limit
    # k > 0: keep exact (softmax, with a KV cache) the k layers whose restoration lowers the model's KL
    # most, measured on the first softmax_probe_seqs training sequences (docs/guide/softmax_layers.md)
    softmax_layers: int = 0
    softmax_probe_seqs: int = 8
    softmax_rank: str = "kl"  # kl (each alone) | kl_greedy (chosen kept exact) | attention_error | retrieval | passkey

    # its keys are built field by field (dofla.stages.keys.dof_settings, student_settings)
    KEYS: ClassVar[Keys] = Keys(legacy={"resamples": 1, "softmax_layers": 0, "softmax_probe_seqs": 8,
                                        "softmax_rank": "kl"})


@dataclass
class BudgetConfig:
    name: str = "head_dim"
    value: Optional[float] = None  # mean feature dimension per layer; None = multiple × head size
    multiple: float = 1.0


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
        in_key=("name", "tokens", "seq_len", "batch_size", "train", "lr", "feature_lr", "scale_lr", "temperature",
                "warmup_steps", "schedule", "grad_clip", "offset", "lora_rank", "lora_alpha", "window_dropout",
                "window_dropout_end", "copy_share", "copy_distance", "teacher_topk"),
        # the teacher-logit cache stores the targets the teacher would give (bit for bit): not what is learnt
        out=("micro_batch_size", "logit_chunk", "checkpoint_every", "log_every", "teacher_cache", "teacher_cache_gb"),
        legacy={"window_dropout": 0.0, "window_dropout_end": None, "logit_chunk": 0, "scale_lr": 0.1, "copy_share": 0.0,
                "copy_distance": 128, "teacher_topk": 0})


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


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "dofla"
    group: Optional[str] = None
    mode: Optional[str] = None  # wandb mode: online | offline | disabled


@dataclass
class PathsConfig:
    # activation caches, prepared data and teacher scores (None: DOFLA_CACHE_DIR or the user cache)
    cache_dir: Optional[str] = None
    outputs_dir: str = "outputs"  # single runs: <outputs_dir>/<date>/<time>
    sweeps_dir: str = "multirun_sweeps"  # -m sweeps: <sweeps_dir>/<date>/<time>/<job number>


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    feature_map: FeatureMapConfig = field(default_factory=FeatureMapConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    paths: PathsConfig = field(default_factory=PathsConfig)
    # where the teacher, student and feature maps run: auto (the GPU when one is visible, under
    # torchrun this rank's), cpu, cuda or cuda:N; data and caches stay in host memory
    device: str = "auto"
    # training arithmetic: fp32 | tf32 (CUDA matmuls) | bf16 (autocast, fp32 master weights; dofla.precision);
    # auto: tf32 where the run's device is a GPU, else fp32 (resolved before anything loads)
    precision: str = "fp32"
    # dof runs when the allocation policy needs it (dofla.validate.stage_plan); list it to run Algorithm 1 under fix
    stages: list[str] = field(default_factory=lambda: ["cache", "allocate", "train", "assemble", "distill", "finetune",
                                                       "eval", "report"])
    experiment: Optional[str] = None

    KEYS: ClassVar[Keys] = Keys(legacy={"precision": "fp32"})


def section_keys() -> dict[str, Keys]:
    """Each section's key declaration by its name in RunConfig (none: no key reads it); ``run`` for
    RunConfig's own fields."""
    sections = {f.name: f.default_factory for f in fields(RunConfig) if isinstance(f.default_factory, type)}
    return {"run": RunConfig.KEYS, **{name: getattr(cls, "KEYS", Keys()) for name, cls in sections.items()}}


# Settings added after artifacts and runs were recorded without them, with the value that reproduces
# what those did (each section's Keys.legacy): a setting at this value is left out of the artifact
# key it belongs to (so older artifacts stay valid, dofla.stages.keys) and filled in when older runs
# are compared (dofla.report).
LEGACY_VALUES: dict[tuple[str, str], Any] = {(name, key): value for name, keys in section_keys().items()
                                             for key, value in keys.legacy.items()}
# Config sections added later: a run recorded without one ran with its defaults.
ADDED_SECTIONS: dict[str, type] = {"distill": DistillConfig, "paths": PathsConfig}
