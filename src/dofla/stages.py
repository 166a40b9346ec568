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

from dofla import distributed
from dofla.artifacts import canonical, settings_digest
from dofla.config import RunConfig
from dofla.feature_maps.blocks import feature_dims
from dofla.record import read_json, write_json
from dofla.validate import feature_budget


def dof_stage(cfg: RunConfig, cache, out_dir: Path) -> dict:
    """Algorithm 1 on the activation cache -> dof.json (shared across runs via the cache dir);
    every copy records its settings, the activation cache's key included, and is reused only for them."""
    a = cfg.allocation
    settings = {"lambda": a.lam, "num_samples": a.num_samples, "gram_norm": a.gram_norm,
                "num_tokens": a.num_tokens, "seed": cfg.seed, "cache_key": cache.key}
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

    from dofla.dof import check_degenerate, estimate_layer_dof
    from dofla.faults import kill_point

    a = cfg.allocation
    partial = read_json(partial_path)
    done = partial["layers"] if partial and partial.get("settings") == settings else {}
    for i in tqdm(range(cache.meta["num_layers"]), desc="dof (Algorithm 1)", unit="layer"):
        if str(i) in done:
            continue
        kill_point(f"dof:layer{i}")
        q, k = _pooled_activations(cache, i, a.num_tokens)
        heads, value = estimate_layer_dof(q, k, a.lam, a.num_samples, a.gram_norm, cfg.seed + i)
        done[str(i)] = {"per_head": [float(h) for h in heads], "layer": float(value)}
        write_json(partial_path, {"settings": settings, "layers": done})
    layers = [done[str(i)] for i in range(cache.meta["num_layers"])]
    per_layer = [layer["layer"] for layer in layers]
    return {"settings": settings, "per_head": [layer["per_head"] for layer in layers],
            "layer_dof": per_layer, "warning": check_degenerate(per_layer, a.num_samples)}


def _pooled_activations(cache, layer: int, num_tokens: int | None):
    """Queries (N, H, d) and keys (N, H_kv, d) of one layer, as float32 tensors."""
    acts = cache.layer(layer)
    seqs = acts.q.shape[0]
    if num_tokens is not None:
        seqs = max(1, min(seqs, -(-num_tokens // acts.q.shape[2])))
    q = torch.from_numpy(acts.q[:seqs].astype("float32"))  # (S, H, L, d)
    k = torch.from_numpy(acts.k[:seqs].astype("float32"))  # (S, H_kv, L, d)
    return q.transpose(1, 2).flatten(0, 1), k.transpose(1, 2).flatten(0, 1)


def allocate_stage(cfg: RunConfig, dof: dict, head_dim: int, num_layers: int, out_dir: Path) -> list:
    """Feature dims from the policy and budget -> allocation.json: one int per layer, or for
    ``dof_head`` one list of per-head ints per layer."""
    from dofla.dof import PER_HEAD_POLICIES, allocate_dims, allocate_head_dims
    from dofla.feature_maps import mean_dim

    a = cfg.allocation
    budget = feature_budget(cfg, head_dim)
    if a.policy in PER_HEAD_POLICIES:
        dims = allocate_head_dims(dof["per_head"], budget, head_dim, a.head_quantum, a.head_blocks)
    else:
        dims = allocate_dims(dof["layer_dof"], budget, a.policy, head_dim)
    assert len(dims) == num_layers
    write_json(out_dir / "allocation.json", {
        "policy": a.policy, "budget": budget, "lambda": a.lam, "gram_norm": a.gram_norm, "dims": dims,
        "layer_dof": dof["layer_dof"], "mean_dim": mean_dim(dims),
    })
    return dims


def build_feature_maps(cfg: RunConfig, geometry, dims: list):
    from dofla.feature_maps import build_layer_feature_map

    return [
        build_layer_feature_map(cfg.feature_map.name, geometry.num_heads, geometry.head_dim, m,
                                seed=cfg.seed + i, **cfg.feature_map.options)
        for i, m in enumerate(dims)
    ]


def layer_train_config(cfg: RunConfig):
    from dofla.train import LayerTrainConfig

    t = cfg.train
    return LayerTrainConfig(
        loss=cfg.loss.name, loss_options=dict(cfg.loss.options), steps=t.steps,
        batch_size=t.batch_size, lr_z=t.lr_z, lr_alpha=t.lr_alpha, lr_other=t.lr_other,
        warmup_steps=t.warmup_steps, schedule=t.schedule, heldout_fraction=t.heldout_fraction,
        eval_every=t.eval_every, patience=t.patience, seed=cfg.seed,
        checkpoint_every=t.checkpoint_every, skip_nonfinite=t.skip_nonfinite, window=cfg.attention.window,
    )


def layer_dir(cfg: RunConfig, out_dir: Path) -> Path:
    """Where layer artifacts live: the run's ``layers/``, or a directory shared by parallel jobs."""
    return Path(cfg.train.layer_dir).expanduser() if cfg.train.layer_dir else out_dir / "layers"


def artifact_meta(cfg: RunConfig, cache_key: str) -> dict:
    """Everything that determines a layer's trained features (not which job trained it)."""
    train = {k: v for k, v in asdict(cfg.train).items() if k not in ("layers", "layer_dir", "checkpoint_every")}
    return {"feature_map": asdict(cfg.feature_map), "loss": asdict(cfg.loss), "window": cfg.attention.window,
            "train": train, "seed": cfg.seed, "cache_key": cache_key}


def layer_settings(cfg: RunConfig, cache_key: str, dims: list) -> dict:
    """The settings of a run's trained layers: :func:`artifact_meta` without the per-layer fields,
    plus every layer's dims (two allocations must not share a directory)."""
    return canonical({**artifact_meta(cfg, cache_key), "dims": dims})


def settings_dir(cfg: RunConfig, out_dir: Path, settings: dict) -> Path:
    """Where this run writes layer artifacts, checkpoints and ``direct_done.json``: the run's own
    ``layers/``, or ``<train.layer_dir>/<hash12 of settings>/`` so that jobs of other settings
    sharing ``train.layer_dir`` never touch each other's files."""
    if not cfg.train.layer_dir:
        return out_dir / "layers"
    return layer_dir(cfg, out_dir) / settings_digest(settings)


def layer_dirs(cfg: RunConfig, out_dir: Path, settings: dict) -> list[Path]:
    """Directories a layer is looked up in: ours first, then (read only) a shared ``train.layer_dir``
    itself, which may hold a run's own flat ``layers/`` of the same settings."""
    own, base = settings_dir(cfg, out_dir, settings), layer_dir(cfg, out_dir)
    return [own] if own == base else [own, base]


def train_stage(cfg: RunConfig, cache, geometry, dims, teacher, train_tokens, out_dir: Path) -> dict:
    """Layerwise (l2 / softmax, from the cache) or end-to-end (direct) feature training."""
    layers = list(range(len(dims))) if cfg.train.layers is None else list(cfg.train.layers)
    meta, settings = artifact_meta(cfg, cache.key), layer_settings(cfg, cache.key, dims)
    directory, *also_read = layer_dirs(cfg, out_dir, settings)
    if distributed.is_main():  # tells a human what the hash directory's name stands for
        write_json(directory / "settings.json", settings)
    if cfg.loss.name == "direct":
        return _train_direct(cfg, dims, teacher, train_tokens, directory, meta, settings)
    from dofla.train import run_layerwise

    feature_maps = build_feature_maps(cfg, geometry, dims)

    def activations(i: int):
        acts = cache.layer(i)
        return torch.from_numpy(acts.q.astype("float32")), torch.from_numpy(acts.k.astype("float32"))

    train_cfg = layer_train_config(cfg)
    if distributed.world() == 1:
        return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read)
    # torchrun: layer i on rank i mod N, then every rank reads all the artifacts
    run_layerwise(feature_maps, activations, distributed.mine(layers), train_cfg, directory, meta, also_read)
    distributed.barrier()
    return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta, also_read)


def _layer_meta(meta: dict, i: int, attn) -> dict:
    return {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}


def _trainable(attn) -> bool:
    return attn.feature_map is not None and any(p.requires_grad for p in attn.feature_map.parameters())


def _train_direct(cfg, dims, teacher, train_tokens, directory: Path, meta: dict, settings: dict) -> dict:
    """End-to-end training, skipped when ``direct_done.json`` has our settings and every layer verifies."""
    from dofla.artifacts import artifact_problem, save_artifact
    from dofla.train import train_direct

    done = directory / "direct_done.json"
    student = make_student(cfg, teacher, dims)
    marker = read_json(done)
    if marker is not None and marker.get("settings") == settings and not any(
            artifact_problem(directory / f"layer_{i:02d}.pt", _layer_meta(meta, i, attn))
            for i, attn in enumerate(student.student_attentions()) if _trainable(attn)):
        return marker
    dcfg = replace(layer_train_config(cfg), batch_size=cfg.train.direct_batch_size)
    curve = train_direct(student, train_tokens, dcfg, checkpoint_path=directory / "direct_ckpt.pt", meta=settings)
    if distributed.is_main():  # under torchrun every rank holds the same features
        for i, attn in enumerate(student.student_attentions()):
            save_artifact(directory / f"layer_{i:02d}.pt", {"state_dict": attn.feature_map.state_dict(),
                                                             "curve": curve}, _layer_meta(meta, i, attn))
        write_json(done, {"settings": settings, "steps": len(curve), "curve": curve})
    distributed.barrier()
    return read_json(done)


def make_student(cfg: RunConfig, teacher, dims):
    from dofla.models import convert

    return convert(copy.deepcopy(teacher), feature_map=cfg.feature_map.name, dims=dims,
                   feature_map_options=dict(cfg.feature_map.options),
                   chunk_size=cfg.attention.chunk_size, seed=cfg.seed,
                   window=cfg.attention.window)


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
    if model_dir_matches(target, settings):
        return _with_settings(load_student(target), settings)
    if (target / "config.json").exists():
        print(f"dofla: {target} was assembled for other settings; assembling it again", flush=True)
    student = make_student(cfg, teacher, dims)
    kill_point("assemble")
    directories = layer_dirs(cfg, out_dir, settings["layers"])
    for i, attn in enumerate(student.student_attentions()):
        _load_trained_layer(i, attn, directories, artifact_meta(cfg, cache_key), layer_dir(cfg, out_dir))
    save_model_dir(student, tokenizer, target, settings)
    return _with_settings(student.eval(), settings)


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
        return _with_settings(load_student(target), settings)
    curve = finetune_lora(student, train_tokens, cfg.finetune, seed=cfg.seed)
    write_json(out_dir / "finetune_curve.json", curve)
    save_model_dir(student, tokenizer, target, settings)
    return _with_settings(student.eval(), settings)
