"""What identifies every artifact, in one place.

An artifact (the activation cache, Algorithm 1's result, a layer's features, the student directory,
the fine-tuned student, an evaluation measurement) is reused only when it was written under the same
settings; these functions build those settings. Two rules keep old artifacts valid:

- every field of a config section that feeds a key is declared beside it, in its section's ``KEYS``
  (:class:`dofla.section_keys.Keys`): in the key or out of it. A field added to a config dataclass without a
  declaration fails loudly (:class:`KeyDeclarationError`) instead of silently changing every key;
- a setting added later is left out of a key while it has its legacy value (``Keys.legacy``, all of
  them in :data:`dofla.config.LEGACY_VALUES`), so artifacts written before it existed keep their key.

:data:`IN_KEY` and :data:`OUT_OF_KEY` list the declarations of the sections that feed a key.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, fields

from dofla.artifacts import canonical
from dofla.attention.forms import FORMS
from dofla.config import LEGACY_VALUES, RunConfig, section_keys
from dofla.models.loading import weights_fields
from dofla.models.plan import read_plan
from dofla.precision import teacher_dtype

# bumped when a feature map's parameters change meaning (2: Hedgehog as published, with a bias),
# so layer artifacts of the old layout are retrained instead of failing to load
ARTIFACT_FORMAT = 2

IN_KEY: dict[str, tuple[str, ...]] = {name: keys.in_key for name, keys in section_keys().items() if keys.in_key}
OUT_OF_KEY: dict[str, tuple[str, ...]] = {name: keys.out for name, keys in section_keys().items() if keys.out}


class KeyDeclarationError(RuntimeError):
    """A config field that no artifact key declares (a developer's error, not a user's)."""


def section(cfg: RunConfig, name: str, legacy: bool = False) -> dict:
    """The key part of config section ``name``: its :data:`IN_KEY` fields; with ``legacy``, without
    the fields at their legacy value."""
    part = getattr(cfg, name)
    keys, values = type(part).KEYS, asdict(part)
    undeclared = sorted({f.name for f in fields(part)} - set(keys.in_key) - set(keys.out))
    if undeclared:
        raise KeyDeclarationError(
            f"{name}.{', '.join(undeclared)} is not declared in {type(part).__name__}.KEYS: add it to in_key (it "
            "then changes artifact keys; give it a legacy value so older artifacts stay valid) or to out")
    out = {k: values[k] for k in keys.in_key}
    if legacy:
        out = {k: v for k, v in out.items() if LEGACY_VALUES.get((name, k), object()) != v}
    return out


def cache_fields(cfg: RunConfig, fingerprint: str, num_tokens: int | None = None) -> dict:
    """What determines the activation cache (its key names the data every later artifact came from)."""
    fields_ = {"model": cfg.model.source, "revision": cfg.model.revision, "data": fingerprint,
               "seq_len": cfg.data.seq_len, "num_tokens": num_tokens or cfg.data.num_tokens, "dtype": "float16",
               **weights_fields(cfg.model.source)}
    if cfg.model.source.startswith("tiny:"):
        fields_["model_seed"], fields_["tiny_layers"] = cfg.seed, cfg.model.tiny_layers
    if cfg.data.shuffle_seed is not None:  # which sequences were cached
        fields_["shuffle_seed"] = cfg.data.shuffle_seed
    dtype = teacher_dtype(cfg.precision, cfg.train.teacher_dtype)
    if dtype != LEGACY_VALUES[("train", "teacher_dtype")]:
        fields_["teacher_dtype"] = dtype
    return fields_


def with_precision(settings: dict, cfg: RunConfig) -> dict:
    """``settings`` plus the training precision, when it is not the legacy fp32."""
    if cfg.precision != LEGACY_VALUES[("run", "precision")]:
        settings["precision"] = cfg.precision
    return settings


def dof_settings(cfg: RunConfig, cache_key: str, layers: list[int] | None, num_layers: int) -> dict:
    """Algorithm 1's result: its estimate's settings, the cache, and (when not every layer) the layers."""
    a = cfg.allocation
    settings = {"lambda": a.lam, "num_samples": a.num_samples, "gram_norm": a.gram_norm,
                "num_tokens": a.num_tokens, "seed": cfg.seed, "cache_key": cache_key,
                "head_aggregate": a.head_aggregate, "spread_samples": a.spread_samples}
    if a.resamples != LEGACY_VALUES[("allocation", "resamples")]:
        settings["resamples"] = a.resamples
    if layers is not None and list(layers) != list(range(num_layers)):
        settings["layers"] = list(layers)  # absent when every layer is estimated, as before the key existed
    return settings


def training_window(cfg: RunConfig) -> tuple[int, int]:
    """(window, sinks) the layerwise loss sees: the attention's, or (0, 0) when a hybrid's features
    learn against full attention (``train.hybrid_target=full``: trained exactly as a linear layer)."""
    a = cfg.attention
    if a.window == 0 or cfg.train.hybrid_target == "full":
        return 0, 0
    return a.window, a.sinks


def layer_meta(cfg: RunConfig, cache_key: str) -> dict:
    """Everything that determines a layer's trained features (not which job trained it). Layers of
    a hybrid trained against full attention have the meta of the same linear run's layers."""
    train = section(cfg, "train", legacy=True)
    train.pop("hybrid_target", None)  # it acts through the training window alone
    window, sinks = training_window(cfg)
    meta = {"feature_map": section(cfg, "feature_map"), "loss": section(cfg, "loss"),
            "window": window, "train": train, "seed": cfg.seed, "cache_key": cache_key,
            "format": ARTIFACT_FORMAT}
    if sinks != LEGACY_VALUES[("attention", "sinks")]:
        meta["sinks"] = sinks
    if cfg.attention.name in FORMS and not FORMS[cfg.attention.name].traits.shares_layers:  # e.g. gates too
        meta["attention"] = cfg.attention.name
    if cfg.attention.plan is not None:  # each group of heads trains with its own form, window and sinks
        meta["plan"] = plan_digest(cfg)
    if train["source"] != "cache":  # a streamed layer also depends on what was streamed
        meta["stream"] = {"data": section(cfg, "data", legacy=True)}
    return with_precision(meta, cfg)


def layer_settings(cfg: RunConfig, cache_key: str, dims: list) -> dict:
    """The settings of a run's trained layers: :func:`layer_meta` without the per-layer fields, plus
    every layer's dims (two allocations must not share a directory)."""
    return canonical({**layer_meta(cfg, cache_key), "dims": dims})


def attention_settings(cfg: RunConfig) -> dict:
    """The student's attention form; the gate and the learned scale absent at their defaults, as
    before the options existed."""
    attention = section(cfg, "attention")
    for option in ("gate", "linear_scale", "plan"):
        if attention[option] == LEGACY_VALUES[("attention", option)]:
            del attention[option]
    if "plan" in attention:
        attention["plan"] = plan_digest(cfg)
    return attention


def plan_digest(cfg: RunConfig) -> str | None:
    """What keys a plan given whole (``attention.plan``): a hash of the plan it holds, so a moved or reformatted
    file keeps its artifacts and an edited one does not; None without a plan."""
    if cfg.attention.plan is None:
        return None
    return "sha256:" + hashlib.sha256(json.dumps(read_plan(cfg.attention.plan).to_list(), sort_keys=True)
                                      .encode()).hexdigest()


def student_settings(cfg: RunConfig, cache_key: str, dims: list) -> dict:
    """What determines the assembled student: the teacher, the attention and the trained layers."""
    settings = {"model": section(cfg, "model"), "attention": attention_settings(cfg),
                "layers": layer_settings(cfg, cache_key, dims)}
    if cfg.allocation.softmax_layers:  # absent at 0, as before the option existed
        a = cfg.allocation
        settings["softmax_layers"] = {"k": a.softmax_layers, "probe_seqs": a.softmax_probe_seqs}
        if a.softmax_rank != "kl":
            settings["softmax_layers"]["rank"] = a.softmax_rank
    return canonical(settings)


def softmax_ranking_settings(cfg: RunConfig, layers: dict) -> dict:
    """The per-layer softmax-restoration measurement: the trained layers (their settings name the
    data and the cache the probe comes from), the probe's size (not k: every k reads it) and the
    student's attention form when it is not plain linear attention: a hybrid trained against full
    attention shares its layers with the linear run, not the KL its restorations give."""
    settings = {"layers": layers, "probe_seqs": cfg.allocation.softmax_probe_seqs}
    attention = attention_settings(cfg)
    del attention["chunk_size"]  # the kernel's chunk changes rounding, not the ranking
    if attention != {"name": "linear", "window": 0, "sinks": 0}:
        settings["attention"] = attention  # absent for plain linear attention, as before the key had it
    return canonical(settings)


def distill_settings(cfg: RunConfig, student: dict | None) -> dict:
    """The distilled student: the student's settings, the distillation's and the seed."""
    distill = section(cfg, "distill", legacy=True)  # without the options added since, at their defaults
    return canonical(with_precision({"student": student, "distill": distill, "seed": cfg.seed}, cfg))


def finetune_settings(cfg: RunConfig, student: dict | None) -> dict:
    """The fine-tuned student: the student's settings, the fine-tune's and the seed."""
    return canonical(with_precision({"student": student, "finetune": section(cfg, "finetune"), "seed": cfg.seed},
                                    cfg))


def teacher_settings(cfg: RunConfig) -> dict:
    """The teacher as an evaluated model: its source and revision (and, for a tiny random model, the
    seed that built it; for the embedded model, its GGUF's hash when the file is a new one:
    :func:`dofla.models.loading.weights_fields`)."""
    tiny = cfg.model.source.startswith("tiny:")
    return {"model": section(cfg, "model"), "seed": cfg.seed if tiny else None, **weights_fields(cfg.model.source)}
