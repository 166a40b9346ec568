"""The pipeline's stages. Each reads its inputs, writes one artifact, and is skipped when that
artifact already exists, so re-running a command resumes where it stopped."""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dofla import distributed
from dofla.config import RunConfig
from dofla.feature_maps.blocks import feature_dims
from dofla.record import read_json, write_json
from dofla.validate import feature_budget


def dof_stage(cfg: RunConfig, cache, out_dir: Path) -> dict:
    """Algorithm 1 on the activation cache -> dof.json (shared across runs via the cache dir)."""
    a = cfg.allocation
    settings = {"lambda": a.lam, "num_samples": a.num_samples, "gram_norm": a.gram_norm,
                "num_tokens": a.num_tokens, "seed": cfg.seed}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    shared = Path(cache.path) / f"dof-{digest}.json"
    result = read_json(out_dir / "dof.json") or read_json(shared)
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


def train_stage(cfg: RunConfig, cache, geometry, dims, teacher, train_tokens, out_dir: Path) -> dict:
    """Layerwise (l2 / softmax, from the cache) or end-to-end (direct) feature training."""
    layers = list(range(len(dims))) if cfg.train.layers is None else list(cfg.train.layers)
    meta = artifact_meta(cfg, cache.key)
    if cfg.loss.name == "direct":
        return _train_direct(cfg, dims, teacher, train_tokens, layer_dir(cfg, out_dir), meta)
    from dofla.train import run_layerwise

    feature_maps = build_feature_maps(cfg, geometry, dims)

    def activations(i: int):
        acts = cache.layer(i)
        return torch.from_numpy(acts.q.astype("float32")), torch.from_numpy(acts.k.astype("float32"))

    train_cfg, directory = layer_train_config(cfg), layer_dir(cfg, out_dir)
    if distributed.world() == 1:
        return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta)
    # torchrun: layer i on rank i mod N, then every rank reads all the artifacts
    run_layerwise(feature_maps, activations, distributed.mine(layers), train_cfg, directory, meta)
    distributed.barrier()
    return run_layerwise(feature_maps, activations, layers, train_cfg, directory, meta)


def _train_direct(cfg, dims, teacher, train_tokens, directory: Path, meta: dict) -> dict:
    from dofla.artifacts import save_artifact
    from dofla.train import train_direct

    done = directory / "direct_done.json"
    if done.exists():
        return read_json(done)
    student = make_student(cfg, teacher, dims)
    dcfg = replace(layer_train_config(cfg), batch_size=cfg.train.direct_batch_size)
    curve = train_direct(student, train_tokens, dcfg, checkpoint_path=directory / "direct_ckpt.pt")
    if distributed.is_main():  # under torchrun every rank holds the same features
        for i, attn in enumerate(student.student_attentions()):
            layer_meta = {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}
            save_artifact(directory / f"layer_{i:02d}.pt", {"state_dict": attn.feature_map.state_dict(),
                                                             "curve": curve}, layer_meta)
        write_json(done, {"steps": len(curve), "curve": curve})
    distributed.barrier()
    return read_json(done)


def make_student(cfg: RunConfig, teacher, dims):
    from dofla.models import convert

    return convert(copy.deepcopy(teacher), feature_map=cfg.feature_map.name, dims=dims,
                   feature_map_options=dict(cfg.feature_map.options),
                   chunk_size=cfg.attention.chunk_size, seed=cfg.seed,
                   window=cfg.attention.window)


def assemble_stage(cfg: RunConfig, teacher, tokenizer, dims, out_dir: Path, cache_key: str):
    """The student as a Hugging Face model directory, with every layer's trained features."""
    from dofla.artifacts import load_artifact
    from dofla.faults import kill_point
    from dofla.models import load_student

    target = out_dir / "student"
    if (target / "config.json").exists():
        return load_student(target)
    student = make_student(cfg, teacher, dims)
    kill_point("assemble")
    meta = artifact_meta(cfg, cache_key)
    for i, attn in enumerate(student.student_attentions()):
        artifact = layer_dir(cfg, out_dir) / f"layer_{i:02d}.pt"
        if attn.feature_map is None:
            continue
        layer_meta = {**meta, "layer": i, "num_features": feature_dims(attn.feature_map)}
        trained = load_artifact(artifact, layer_meta)
        if trained is not None:
            attn.feature_map.load_state_dict(trained["state_dict"])
        elif any(p.requires_grad for p in attn.feature_map.parameters()):
            print(f"dofla: layer {i} has no trained features ({artifact.name} missing); "
                  "it keeps its initial features", flush=True)
    _save_model_dir(student, tokenizer, target)
    return student.eval()


def _save_model_dir(model, tokenizer, target: Path) -> None:
    import os
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finetune_stage(cfg: RunConfig, student, tokenizer, train_tokens, out_dir: Path):
    """Optional LoRA fine-tune of the assembled student -> student_finetuned/ (merged weights)."""
    from dofla.models import load_student
    from dofla.train.finetune import finetune_lora

    target = out_dir / "student_finetuned"
    if (target / "config.json").exists():
        return load_student(target)
    curve = finetune_lora(student, train_tokens, cfg.finetune, seed=cfg.seed)
    write_json(out_dir / "finetune_curve.json", curve)
    _save_model_dir(student, tokenizer, target)
    return student.eval()
