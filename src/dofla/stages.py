"""The pipeline's stages. Each reads its inputs and writes one artifact that records the settings
that produced it; a stage is skipped when its artifact exists for the SAME settings, so re-running
a command resumes where it stopped, and changing a setting redoes what depends on it."""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dofla.artifacts import canonical
from dofla.config import RunConfig
from dofla.record import read_json, write_json
from dofla.train_stage import (  # noqa: F401  (the training stage lives in its own module)
    _layer_meta,
    _trainable,
    artifact_meta,
    build_feature_maps,
    layer_dir,
    layer_dirs,
    layer_settings,
    layer_train_config,
    linear_layers,
    settings_dir,
    train_stage,
)
from dofla.validate import feature_budget


def dof_stage(cfg: RunConfig, cache, out_dir: Path, layers: list[int] | None = None) -> dict:
    """Algorithm 1 on the activation cache -> dof.json (shared across runs via the cache dir);
    every copy records its settings, the activation cache's key included, and is reused only for them.
    ``layers``: the layers that get features (default all); the others (a teacher's sliding-window
    layers, kept exact) are not estimated and read ``null``."""
    a = cfg.allocation
    settings = {"lambda": a.lam, "num_samples": a.num_samples, "gram_norm": a.gram_norm,
                "num_tokens": a.num_tokens, "seed": cfg.seed, "cache_key": cache.key,
                "head_aggregate": a.head_aggregate, "spread_samples": a.spread_samples}
    if a.resamples > 1:  # absent at 1, so a single-sample dof.json written before the key existed stays valid
        settings["resamples"] = a.resamples
    if layers is not None and list(layers) != list(range(cache.meta["num_layers"])):
        settings["layers"] = list(layers)  # absent when every layer is estimated, as before the key existed
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    shared = Path(cache.path) / f"dof-{digest}.json"
    result = read_json(out_dir / "dof.json")
    if result is None or result.get("settings") != settings:
        result = read_json(shared)
    if result is None or result.get("settings") != settings:
        result = _run_algorithm1(cfg, cache, settings, out_dir / "dof.partial.json")
        write_json(shared, result)
    write_json(out_dir / "dof.json", result)
    if result.get("warning"):
        print(f"dofla: warning: {result['warning']}", flush=True)
    return result


def _run_algorithm1(cfg: RunConfig, cache, settings: dict, partial_path: Path) -> dict:
    """Per-layer DoF, saved after every layer so a killed run redoes only the layers it lacks."""
    from tqdm.auto import tqdm

    from dofla.dof import check_degenerate
    from dofla.dof.algorithm import estimate_layer_dof_averaged, layer_dof_spread
    from dofla.faults import kill_point

    a = cfg.allocation
    partial = read_json(partial_path)
    done = partial["layers"] if partial and partial.get("settings") == settings else {}
    estimated = settings.get("layers", range(cache.meta["num_layers"]))
    for i in tqdm(estimated, desc="dof (Algorithm 1)", unit="layer"):
        if str(i) in done:
            continue
        kill_point(f"dof:layer{i}")
        q, k = _pooled_activations(cache, i, a.num_tokens)
        # sample r draws with seed + i + 1000·r: r = 0 is the single-sample estimate
        heads, value, samples = estimate_layer_dof_averaged(
            q, k, a.lam, a.num_samples, a.gram_norm, [cfg.seed + i + 1000 * r for r in range(a.resamples)],
            aggregate=a.head_aggregate)
        done[str(i)] = {"per_head": [float(h) for h in heads], "layer": float(value)}
        if a.resamples > 1:
            done[str(i)]["samples"] = samples
        if a.spread_samples:  # the estimate on other J-samples: how stable the dims built on one sample are
            seeds = [cfg.seed + i + 1000 * (a.resamples + r) for r in range(a.spread_samples)]
            done[str(i)]["spread"] = layer_dof_spread(q, k, a.lam, a.num_samples, a.gram_norm, seeds,
                                                      a.head_aggregate)
        write_json(partial_path, {"settings": settings, "layers": done})
    skipped = {"per_head": None, "layer": None, "samples": None, "spread": None}
    layers = [done.get(str(i), skipped) for i in range(cache.meta["num_layers"])]
    per_layer = [layer["layer"] for layer in layers]
    result = {"settings": settings, "per_head": [layer["per_head"] for layer in layers],
              "layer_dof": per_layer,
              "warning": check_degenerate([n for n in per_layer if n is not None], a.num_samples)}
    if a.resamples > 1:
        result["samples"] = [layer["samples"] for layer in layers]  # each J-sample's layer value
    if a.spread_samples:
        result["spread"] = [layer["spread"] for layer in layers]
    return result


def _pooled_activations(cache, layer: int, num_tokens: int | None):
    """Queries (N, H, d) and keys (N, H_kv, d) of one layer, as float32 tensors."""
    acts = cache.layer(layer)
    seqs = acts.q.shape[0]
    if num_tokens is not None:
        seqs = max(1, min(seqs, -(-num_tokens // acts.q.shape[2])))
    q = torch.from_numpy(acts.q[:seqs].astype("float32"))  # (S, H, L, d)
    k = torch.from_numpy(acts.k[:seqs].astype("float32"))  # (S, H_kv, L, d)
    return q.transpose(1, 2).flatten(0, 1), k.transpose(1, 2).flatten(0, 1)


def allocate_stage(cfg: RunConfig, dof: dict | None, geometry, out_dir: Path, cache=None) -> list:
    """Feature dims from the policy and budget -> allocation.json: one int per layer, or for
    ``dof_head`` one list of per-head ints per layer.

    Only layers that get feature maps share the budget (:func:`linear_layers`); a teacher
    sliding-window layer stays exact and gets 0. ``dof`` is None when Algorithm 1 did not run
    (``fix``); ``measured`` trains briefly at a few dims per layer (:mod:`dofla.dof.oracle`).
    """
    from dofla.dof import PER_HEAD_POLICIES, allocate_dims, allocate_head_dims
    from dofla.feature_maps import mean_dim

    a, head_dim = cfg.allocation, geometry.head_dim
    budget = feature_budget(cfg, head_dim)
    layers = linear_layers(cfg, geometry)
    pick = (lambda values: [values[i] for i in layers]) if dof is not None else (lambda values: None)
    layer_dof = pick(dof["layer_dof"]) if dof is not None else None
    record = {}
    if not layers:
        chosen = []
    elif a.policy in PER_HEAD_POLICIES:
        chosen = allocate_head_dims(pick(dof["per_head"]), budget, head_dim, a.head_quantum, a.head_blocks)
    elif a.policy == "measured":
        from dofla.dof.oracle import measured_allocation

        train_cfg = replace(layer_train_config(cfg), softcap=geometry.softcap)
        record = measured_allocation(cfg, cache, geometry, train_cfg, budget, layer_dof, layers, out_dir)
        chosen = record["dims"]
    else:  # fix reads only how many layers there are
        chosen = allocate_dims(layer_dof if layer_dof is not None else [0.0] * len(layers), budget, a.policy,
                               head_dim)
    dims: list = [0] * geometry.num_layers
    for i, m in zip(layers, chosen):
        dims[i] = m
    write_json(out_dir / "allocation.json", {
        **record, "policy": a.policy, "budget": budget, "lambda": a.lam, "gram_norm": a.gram_norm, "dims": dims,
        "layer_dof": None if dof is None else dof["layer_dof"], "linear_layers": layers,
        "mean_dim": mean_dim(chosen) if chosen else 0.0,
    })
    return dims


def make_student(cfg: RunConfig, teacher, dims):
    from dofla.models import convert

    return convert(copy.deepcopy(teacher), feature_map=cfg.feature_map.name, dims=dims,
                   feature_map_options=dict(cfg.feature_map.options),
                   chunk_size=cfg.attention.chunk_size, seed=cfg.seed,
                   window=cfg.attention.window, attention=cfg.attention.name, sinks=cfg.attention.sinks)


def student_settings(cfg: RunConfig, cache_key: str, dims: list) -> dict:
    """What determines the assembled student: the teacher, the attention and the trained layers."""
    return canonical({"model": asdict(cfg.model), "attention": asdict(cfg.attention),
                      "layers": layer_settings(cfg, cache_key, dims)})


def assemble_stage(cfg: RunConfig, teacher, tokenizer, dims, out_dir: Path, cache_key: str):
    """The student as a Hugging Face model directory, with every layer's trained features.

    ``student/`` is reused only when its ``dofla_settings.json`` matches these settings. Raises
    :class:`ArtifactError` when a layer with trainable features has no verified artifact.
    """
    from dofla.artifacts import model_dir_matches, save_model_dir
    from dofla.faults import kill_point
    from dofla.models import load_student

    target, settings = out_dir / "student", student_settings(cfg, cache_key, dims)
    if model_dir_matches(target, settings):  # loads on the CPU: join the teacher's device
        return _with_settings(load_student(target).to(next(teacher.parameters()).device), settings)
    if (target / "config.json").exists():
        print(f"dofla: {target} was assembled for other settings; assembling it again", flush=True)
    student = make_student(cfg, teacher, dims)
    student.config.dofla_run = run_provenance(cfg)  # for the model card
    kill_point("assemble")
    directories = layer_dirs(cfg, out_dir, settings["layers"])
    for i, attn in enumerate(student.student_attentions()):
        _load_trained_layer(i, attn, directories, artifact_meta(cfg, cache_key), layer_dir(cfg, out_dir))
    save_model_dir(student, tokenizer, target, settings)
    return _with_settings(student.eval(), settings)


def run_provenance(cfg: RunConfig) -> dict:
    """How the student was made, in its config.json and model card."""
    return {"teacher": cfg.model.source, "revision": cfg.model.revision, "loss": cfg.loss.name,
            "allocation": cfg.allocation.policy, "seed": cfg.seed}


def _load_trained_layer(i: int, attn, directories: list[Path], meta: dict, base: Path) -> None:
    """Load layer ``i``'s verified features into ``attn``; a layer with nothing to train needs none."""
    from dofla.artifacts import ArtifactError, artifact_problem
    from dofla.train.layerwise import find_artifact

    if attn.feature_map is None:
        return
    name, layer_meta = f"layer_{i:02d}.pt", _layer_meta(meta, i, attn)
    trained = find_artifact(directories, name, layer_meta)
    if trained is not None:
        attn.feature_map.load_state_dict(trained["state_dict"])
    elif _trainable(attn):
        problem = artifact_problem(directories[0] / name, layer_meta)
        raise ArtifactError(
            f"layer {i} has no usable trained features ({directories[0] / name}: {problem}); train it by "
            f"running the same command with train.layers=[{i}] and train.layer_dir={base}, or run without "
            "train.layers to train every layer")


def _with_settings(model, settings: dict):
    """Attach the settings a model was built from (the eval stage keys its measurements by them)."""
    model.dofla_settings = settings
    return model


def finetune_stage(cfg: RunConfig, student, tokenizer, train_tokens, out_dir: Path):
    """Optional LoRA fine-tune of the assembled student -> student_finetuned/ (merged weights),
    reused only when its ``dofla_settings.json`` matches (student's settings + fine-tune settings)."""
    from dofla.artifacts import model_dir_matches, save_model_dir
    from dofla.models import load_student
    from dofla.train.finetune import finetune_lora

    target = out_dir / "student_finetuned"
    settings = canonical({"student": getattr(student, "dofla_settings", None),
                          "finetune": asdict(cfg.finetune), "seed": cfg.seed})
    if model_dir_matches(target, settings):
        return _with_settings(load_student(target).to(next(student.parameters()).device), settings)
    curve = finetune_lora(student, train_tokens, cfg.finetune, seed=cfg.seed)
    write_json(out_dir / "finetune_curve.json", curve)
    save_model_dir(student, tokenizer, target, settings)
    return _with_settings(student.eval(), settings)
