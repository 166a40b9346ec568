"""Each training stage's own step, runnable on cut copies of the teacher (random weights, any depth,
any number of sequences): what the memory preflight traces (:mod:`dofla.train.capacity`), the startup
estimate times on the run's device (:mod:`dofla.stages.estimate`) and the cost model counts
(``studies/cost_model.py``). Every builder returns ``step(depth, micro)``: a callable that runs the
stage's step on a ``depth``-layer cut at ``micro`` sequences.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from dofla.train.continuation_step import finetune_step
from dofla.models.adapters.support import get_adapter
from dofla.train.direct import train_direct
from dofla.train.distill import train_kl
from dofla.train.layerwise import layer_loss, needs_values, param_groups
from dofla.train.live import Live
from dofla.train.stream import _train_step


def cut_to(model, layers: int, device: str | torch.device = "cpu"):
    """A fresh, randomly initialised copy of ``model``'s architecture with ``layers`` layers (fp32), built
    on ``device`` (seeded on the CPU; on a GPU its own generator draws the weights)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    for name in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:layers])
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config).float().eval()


def stream_step(teacher, feature_maps: list, layers: list[int], cfg, seq_len: int, dtype=torch.float32,
                steps: int = 2, device: str | torch.device = "cpu"):
    """``step(depth, micro)``: a callable that runs ``steps`` streamed layerwise steps
    (``dofla.train.stream``) on a ``depth``-layer cut of ``teacher`` in ``dtype`` (its distillation
    copy's) at ``micro`` random sequences: one teacher forward, every layer's loss and backward, one
    Adam step per layer (each layer has the widest of ``layers``' features), on ``device``. The memory
    trace, the startup estimate (on the run's device) and the cost model (``studies/cost_model.py``) run it."""
    widest = widest_layer(feature_maps, layers)
    models: dict[int, torch.nn.Module] = {}

    def step(depth: int, micro: int):
        if depth not in models:
            models[depth] = cut_to(teacher, depth, device).to(dtype)
        model = models[depth]
        maps = [copy.deepcopy(feature_maps[widest]).to(device) for _ in range(depth)]
        optimizers = {i: torch.optim.Adam(param_groups(maps[i], cfg)) for i in range(depth) if list(maps[i].parameters())}
        state = {"step": 0, "teacher_seconds": 0.0,
                 "layers": {i: {"stopped": i not in optimizers, "seconds": 0.0, "curve": []} for i in range(depth)}}
        ids = torch.randint(0, model.config.vocab_size, (micro, seq_len), device=device)
        whole = replace(cfg, micro_batch_size=None, skip_nonfinite=True)
        lrs = {i: [g["lr"] for g in opt.param_groups] for i, opt in optimizers.items()}
        return lambda: [_train_step(model, attention_modules(model), ids, maps, optimizers, lrs, state, whole,
                                    Live(None, 1, 0)) for _ in range(steps)]

    return step


def cached_step(feature_maps: list, layers: list[int], cfg, seq_len: int, geometry, device="cpu"):
    """``step(depth, micro)``: a callable that runs two layerwise steps on cached activations
    (``dofla.train.layerwise``: one layer's loss, backward and Adam step) at ``micro`` random rows of
    q, k (v), for the widest of ``layers``' features; ``depth`` does not matter (layers train one
    after another)."""
    widest = widest_layer(feature_maps, layers)
    heads, kv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim

    def step(depth: int, micro: int):
        feature_map = copy.deepcopy(feature_maps[widest]).to(device)
        optimizer = torch.optim.Adam(param_groups(feature_map, cfg)) if list(feature_map.parameters()) else None

        def steps():
            for _ in range(2):
                q, k = (torch.randn(micro, n, seq_len, d, device=device) for n in (heads, kv))
                v = torch.randn(micro, kv, seq_len, d, device=device) if needs_values(cfg.loss) else None
                loss = layer_loss(feature_map, q, k, cfg, v)
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()

        return steps

    return step


def model_step(student_of, teacher, seq_len: int, run, device: str | torch.device = "cpu"):
    """``step(depth, micro)``: a callable that runs ``run(student, cut, tokens)`` on a fresh copy of the
    student of a ``depth``-layer cut of ``teacher`` (``student_of(cut)`` converts it), the cut teacher,
    and ``micro`` random sequences, on ``device``: a step of a stage that trains the whole student."""
    models: dict[int, tuple] = {}

    def step(depth: int, micro: int):
        if depth not in models:
            cut = cut_to(teacher, depth, device)
            models[depth] = (cut, student_of(cut).to(device))
        cut, student = models[depth]
        student = copy.deepcopy(student)
        tokens = torch.randint(0, student.config.vocab_size, (micro, seq_len), device=device)
        return lambda: run(student, cut, tokens)

    return step


def direct_step(student_of, teacher, cfg, seq_len: int, steps: int = 2, device: str | torch.device = "cpu"):
    """``steps`` end-to-end (``direct``) steps (:func:`model_step`)."""
    return model_step(student_of, teacher, seq_len, lambda student, _, tokens: train_direct(
        student, tokens, replace(cfg, steps=steps, batch_size=len(tokens), micro_batch_size=None), progress=False),
        device)


def task_step(model_of, teacher, seq_len: int, precision: str = "fp32", steps: int = 2,
              device: str | torch.device = "cpu"):
    """``steps`` steps of the evaluation protocol's task fine-tune
    (:func:`dofla.train.continuation_step.finetune_step`: every parameter of ``model_of(cut)``, AdamW) on
    rows of ``seq_len`` tokens that are all targets: its worst case, every row at the maximum length."""
    def run(model, _, tokens):
        for p in model.parameters():
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        rows = [([], row) for row in tokens.tolist()]
        return [finetune_step(model, optimizer, rows, seq_len, None, precision) for _ in range(steps)][-1]

    return model_step(model_of, teacher, seq_len, run, device)


def kl_step(student_of, teacher, schedule, train: list[str], lora: tuple[int, int], seq_len: int,
            device="cpu"):
    """``step(depth, micro)``: two steps of the distill stage (``distill=kl``,
    :func:`dofla.train.distill.train_kl`: the teacher's forward, the student's forward and backward,
    the KL on their logits, AdamW on what ``train`` names) on the same random batch."""
    def run(student, cut, tokens):
        batches = SimpleNamespace(next_batch=lambda: tokens, state=dict, restore=lambda _: None,
                                  batch_tokens=tokens.numel())  # the same batch every step
        train_kl(student, cut, batches, train, replace(schedule, steps=2, micro_batch_size=len(tokens),
                                                               log_every=2, warmup_steps=0), lora=lora, progress=False)

    return model_step(student_of, teacher, seq_len, run, device)


def widest_layer(feature_maps: list, layers: list[int]) -> int:
    """The layer whose features have the most parameters (the one a per-layer trace sizes)."""
    return max(layers, key=lambda i: sum(p.numel() for p in feature_maps[i].parameters()))


def attention_modules(model):
    return get_adapter(model).attention_modules(model)
