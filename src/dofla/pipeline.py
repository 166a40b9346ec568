"""One run: check -> load -> data -> cache -> dof -> allocate -> train -> assemble -> distill -> finetune -> eval
-> report.

``run(cfg, out_dir)`` is what the ``dofla`` command calls after Hydra composed the config; it is
equally callable from Python. Every stage (one module each in :mod:`dofla.stages`) writes its artifact
into ``out_dir``, keyed by the settings that made it (the activation cache and Algorithm 1's result
are shared across runs), so re-running resumes. Under torchrun every rank runs this; rank 0 writes.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from dofla import distributed
from dofla.config import RunConfig
from dofla.dof.config import BUDGET_POLICY
from dofla.eval.probes import long_tokens
from dofla.eval.suite import plan_tasks
from dofla.models import get_adapter, load_teacher
from dofla.models.loading import teacher_config, teacher_identity
from dofla.models.card import lm_eval_settings, write_model_card
from dofla.precision import configure_matmul, resolve, teacher_dtype
from dofla.record import build_record, read_json, write_json
from dofla.stages import allocate, assemble, cache, data, distill, dof, finetune, preflight, report, train
from dofla.stages import estimate as predicted_time
from dofla.stages import softmax_layers
from dofla.stages import eval as evaluation
from dofla.stages.context import RunContext, RunData, StageTimer
from dofla.stages.results import DofResult, TrainResult
from dofla.stages.students import (allocated_plan_path, check_budget_run, check_given_plan, layer_dir, linear_layers,
                                   plan_dims, plan_memory)
from dofla.tracking import NullTracker
from dofla.validate import stage_plan, validate_against_model, validate_config, validate_output_dir
from dofla.world import train_split, validate_world

logger = logging.getLogger(__name__)


def run(cfg: RunConfig, out_dir: str | Path, overrides: list[str] = (), tracker=None) -> dict:
    """Run the stages ``stage_plan(cfg)`` names in ``out_dir``; returns the metrics (also in metrics.json)."""
    out_dir, timer = Path(out_dir), StageTimer()
    tracker = timer.watch(tracker or NullTracker())  # the live logs also time the training steps
    main = distributed.is_main()
    # Every check that needs no model (config, world, run directory, data files, lm-eval tasks); the
    # data is opened (prepared tokens when they exist) and data.num_tokens=all becomes a number.
    cfg, plan, source, tasks = check_before_loading(cfg, out_dir)
    torch.manual_seed(cfg.seed)
    # The teacher, its geometry, and where training reads activations from (printed with the costs).
    with timer("load"):
        ctx = load(cfg, out_dir, plan, source)
    timer.device = next(ctx.teacher.parameters()).device  # where the stages' peak memory is measured
    # Token tensors: the training tokens the cache needs and the held-out tokens.
    with timer("data"):
        tokens = data.run(ctx)
    if main:
        write_json(out_dir / "run.json", {**build_record(cfg, overrides, teacher_identity(cfg.model.source, cfg.model.revision)), "cache_key": tokens.cache_key,
                                          "world_size": distributed.world(), "stages": list(plan),
                                          "train_source": ctx.train.source,
                                          "train_parallel": train_split(cfg, distributed.world(), ctx.train.source)})
    # The teacher's q, k, v over the training tokens (shared by every run with the same data).
    activations = None
    if "cache" in plan:
        with timer("cache"):
            activations = cache.run(ctx, tokens)
    # Algorithm 1: degrees of freedom per layer (and head), for the layers that get features.
    estimate = None
    if "dof" in plan:
        with timer("dof"):
            estimate = distributed.main_first(dof.run, ctx, activations, linear_layers(cfg, ctx.geometry))
    # Feature dims per layer under the budget.
    dims = plan_dims(cfg, ctx.geometry) or [0] * ctx.geometry.num_layers  # a plan's, or training-free: none
    allocation = None  # allocation=budget's record
    if "allocate" in plan:
        with timer("allocate"):
            if cfg.allocation.policy == BUDGET_POLICY:  # a plan per KV head: the later stages read it as attention.plan
                ctx, allocation = allocated(ctx, tokens, estimate)
                cfg, dims = ctx.cfg, plan_dims(ctx.cfg, ctx.geometry)
            else:
                dims = distributed.main_first(allocate.run, ctx, estimate, activations).dims
    if "allocate" in plan or "train" not in plan:
        report.log_allocation(tracker, estimate, dims)
    if "train" not in plan and "assemble" not in plan:
        return {}
    # The memory preflight of the train and distill stages, before either runs: each stage's peak on
    # this device from a trace of its step (micro_batch_size=auto picks the largest that fits).
    ctx = preflight.run(ctx, dims, plan, timer.predicted)
    # The predicted time of every stage on this device (each stage's step timed on cut models).
    if cfg.train.preflight:
        predicted_time.run(ctx, dims, plan, timer.predicted)
    # Each layer's features, layerwise (cache or stream) or end to end (direct).
    trained = TrainResult()
    if "train" in plan:
        with timer("train"):
            trained = train.run(ctx, activations, dims, tokens, tracker if main else None)
        if trained.direct is None and main:
            write_json(out_dir / "train_summary.json",
                       {f"layer_{i:02d}": v for i, v in sorted(trained.summaries.items())})
            report.log_training(tracker, trained.summaries)
    if cfg.train.layers is not None and len(set(cfg.train.layers)) < ctx.geometry.num_layers:
        if main:
            logger.info(f"dofla: trained layers {sorted(set(cfg.train.layers))} into {layer_dir(cfg, out_dir)}; "
                  "run again without train.layers (same train.layer_dir) to assemble and evaluate")
        return {}
    if "assemble" not in plan:
        return {}
    # The student as a Hugging Face model directory.
    with timer("assemble"):
        student = distributed.main_first(assemble.run, ctx, dims, tokens.cache_key, tokens.train_tokens).student
    # Optional model-level distillation: KL to the teacher's next-token distributions on fresh text
    # (under torchrun every rank trains on its share of each batch).
    distilled = "distill" in plan  # distill=kl turns it on (dofla.stages.plan.switched_stages)
    if distilled:
        with timer("distill"):
            result = distill.run(ctx, student, tokens, tracker if main else None)
        student = result.student
    # Optional LoRA fine-tune of the (distilled) student.
    finetuned = "finetune" in plan
    if finetuned:
        with timer("finetune"):
            student = distributed.main_first(finetune.run, ctx, student, tokens).student
    if "eval" not in plan:
        return {}
    # Teacher and student on held-out text, tasks and probes.
    with timer("eval"):
        metrics = evaluation.run(ctx, student, tokens, tasks).metrics
    metrics.update(data_budget(ctx, tokens, trained, activations))
    metrics.update(softmax_layers.metrics(student))
    if cfg.attention.plan is not None and cfg.eval.memory_contexts:  # a plan (given or allocated): what it predicts
        metrics.update(plan_memory(student, cfg.eval.memory_contexts))
    if cfg.allocation.policy == BUDGET_POLICY and "allocate" in plan:
        metrics.update(budget_metrics(allocation, timer.seconds))
    if distilled:
        metrics["distill/tokens"] = int(result.tokens)
        metrics.update(distill_endpoints(out_dir))
    # Measured beside predicted: each stage's peak memory and step time, the preflight's peaks.
    metrics.update(timer.metrics({"eval": metrics["finetuned/step_s"]} if "finetuned/step_s" in metrics else None))
    if main:
        write_json(out_dir / "metrics.json", metrics)
        final = "student_finetuned" if finetuned else distill.TARGET if distilled else "student"
        write_card(out_dir / final, metrics)
        # Timings, the tracker, report.md and plots, the summary.
        report.run(ctx, metrics, timer, tracker)
    return metrics


def check_before_loading(cfg: RunConfig, out_dir: Path):
    """Every check that needs no model: config, world size, run directory, data files, lm-eval tasks.

    Returns (the config with data.num_tokens resolved, the stages to run, the checked data source,
    the eval task plan or None).
    """
    validate_config(cfg)
    check_budget_run(cfg)
    cfg = with_budget_context(cfg)
    # a plan given whole (attention.plan), against the teacher's config: its layers and heads
    check_given_plan(cfg, teacher_config(cfg.model.source, cfg.model.revision, cfg.model.tiny_layers))
    cfg = resolve_precision(cfg)
    validate_world(cfg, distributed.world())
    validate_output_dir(out_dir)
    plan = stage_plan(cfg)
    cfg, source = data.open_or_prepare(cfg)  # prepared tokens, or the text source (its files checked)
    tasks = None
    if cfg.eval.tasks and "eval" in plan and distributed.is_main():

        others = cfg.eval.perplexity or cfg.eval.attention_error or cfg.eval.mqar
        tasks = plan_tasks(cfg.eval, out_dir, others_requested=others)
    return cfg, plan, source, tasks


def with_budget_context(cfg: RunConfig) -> RunConfig:
    """Under ``allocation=budget``, ``eval.memory_contexts`` with ``budget.context`` added: the eval measures
    the decode memory the budget is about."""
    contexts = list(cfg.eval.memory_contexts)
    if cfg.allocation.policy != BUDGET_POLICY or cfg.budget.context in contexts:
        return cfg
    return replace(cfg, eval=replace(cfg.eval, memory_contexts=[*contexts, cfg.budget.context]))


def allocated(ctx: RunContext, tokens: RunData, estimate: DofResult | None = None) -> tuple[RunContext, dict]:
    """``allocation=budget``'s plan measured and chosen on the training tokens (:func:`allocate.run_budget`;
    ``estimate``: the dof stage's, which ``budget.state_sizing=dof`` reads), and the context whose
    ``attention.plan`` is that plan's file (so the plan's stages and keys follow it)."""
    _, record = distributed.main_first(allocate.run_budget, ctx, tokens.train_tokens, estimate)
    attention = replace(ctx.cfg.attention, plan=str(allocated_plan_path(ctx.out_dir)))
    return replace(ctx, cfg=replace(ctx.cfg, attention=attention)), record


def budget_metrics(record: dict, seconds: dict) -> dict:
    """The budget and the plan's bytes at ``budget.context`` (beside the eval's measured
    ``memory/student/decode_mib/T<context>``), and what the allocation cost beside the training's time:
    ``allocation/cost_s`` this allocation's seconds, ``allocation/menu_s`` the menu's measurement's (which a
    later budget reuses: ``allocation/menu_reused`` 1)."""
    context, cost = record["budget"]["context"], record["cost"]["seconds"]
    training = seconds.get("train", 0.0) + seconds.get("distill", 0.0)
    metrics = {f"memory/budget_mib/T{context}": record["budget"]["mib"],
               f"allocation/plan_mib/T{context}": record["plan_bytes"] / 2**20,
               "allocation/slack_mib": record["slack_bytes"] / 2**20, "allocation/cost_s": cost}
    if training and not record["reused"]:  # absent unless both were spent in this run (not reused)
        metrics["allocation/share_of_training"] = cost / training
    measurement = record.get("menu_measurement")
    if measurement:  # the menu's measurement, this run's own or another budget's it solved on
        metrics["allocation/menu_s"] = measurement["seconds"]
        metrics["allocation/menu_reused"] = float(measurement["reused"])
    return metrics


def resolve_precision(cfg: RunConfig) -> RunConfig:
    """``precision=auto`` made tf32 on a GPU and fp32 on the CPU (said once); other settings unchanged."""
    if cfg.precision != "auto":
        return cfg
    chosen = resolve(cfg.precision, cfg.device)
    if distributed.is_main():
        where = torch.cuda.get_device_name(distributed.device(cfg.device)) if chosen == "tf32" else "the CPU"
        logger.info(f"dofla: precision=auto: {chosen} on {where}")
    return replace(cfg, precision=chosen)


def load(cfg: RunConfig, out_dir: Path, plan: list[str], data_source=None) -> RunContext:
    """Load the teacher onto ``cfg.device``, check the config against it, plan the training (its mode,
    source and token ledger: the :class:`~dofla.stages.plan.TrainPlan` every stage reads);
    ``data_source``: the data :func:`check_before_loading` opened (kept in the context)."""
    configure_matmul(cfg.precision)
    teacher, tokenizer = load_teacher(cfg.model.source, cfg.model.revision, cfg.seed, cfg.model.tiny_layers)
    teacher = teacher.to(distributed.device(cfg.device))  # the student is a copy: it follows
    geometry = get_adapter(teacher).geometry(teacher.config)
    validate_against_model(cfg, geometry.num_layers, geometry.head_dim, geometry.max_positions)
    check_given_plan(cfg, geometry=geometry)  # where its config could not be read before loading
    needs_capture = "cache" in plan or "train" in plan
    capture = data.capture_teacher(teacher, teacher_dtype(cfg.precision, cfg.train.teacher_dtype)) \
        if needs_capture else teacher
    training = distributed.broadcast(data.plan_training(cfg, plan, geometry, capture) if distributed.is_main()
                                     else None)
    validate_world(cfg, distributed.world(), training.source)  # torchrun's split, now that the source is known
    return RunContext(cfg, out_dir, tuple(plan), teacher, tokenizer, geometry, capture, training, data_source)


def heldout_tokens(cfg: RunConfig, tokenizer) -> torch.Tensor:
    """(S', data.seq_len) the held-out tokens every evaluation of ``cfg``'s data measures on."""
    return data.pack_heldout(cfg, tokenizer, data.open_data(cfg)[1])


def long_heldout_tokens(cfg: RunConfig, tokenizer) -> torch.Tensor:
    """(eval.long_context_seqs, eval.long_seq_len) the long held-out tokens the position and passkey
    measurements read."""
    return long_tokens(cfg, tokenizer, data.open_data(cfg)[1])


def data_budget(ctx: RunContext, tokens: RunData, trained: TrainResult, activations) -> dict:
    """``train/tokens``: distinct distillation tokens the features saw (the cached tokens, or the
    tokens streamed); ``cache/bytes``: the activation cache's size on disk (0 without a cache)."""
    seen = trained.tokens()
    if seen is None:
        seen = tokens.train_tokens.numel() if ctx.train.reads_cache else 0
    return {"train/tokens": int(seen), "cache/bytes": int(activations.nbytes()) if activations is not None else 0}


def distill_endpoints(out_dir: Path, steps: int = 8) -> dict:
    """What the KL stage reached: the mean batch KL of its first and last ``steps`` logged steps
    (``distill/kl_first``, ``distill/kl_last``), from ``distill_summary.json``'s curve."""
    curve = [point["kl"] for point in (read_json(out_dir / "distill_summary.json") or {}).get("curve", [])
             if point.get("kl") is not None]
    if not curve:
        return {}
    return {"distill/kl_first": sum(curve[:steps]) / len(curve[:steps]),
            "distill/kl_last": sum(curve[-steps:]) / len(curve[-steps:])}


def write_card(student_dir: Path, metrics: dict) -> None:
    """The evaluated student's model card, with the run's numbers and how its lm-eval scores were made."""
    write_model_card(student_dir, metrics, lm_eval=lm_eval_settings(student_dir.parent, metrics))
