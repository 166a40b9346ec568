"""cache -> dof -> allocate -> train -> assemble -> eval -> report, for one run directory.

``run(cfg, out_dir)`` is what the ``dofla`` command calls after Hydra composed the config; it is
equally callable from Python. Every stage writes its artifact into ``out_dir`` (the activation
cache and Algorithm 1's result are shared across runs, keyed by what determines them).
"""
from __future__ import annotations

import copy
import io
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console

from dofla import distributed
from dofla.config import RunConfig
from dofla.feature_maps.blocks import layer_mean_dim, mean_dim
from dofla.record import build_record, read_json, write_json
from dofla.train_stage import cached_tokens, choose_train_source
from dofla.validate import (stage_plan, validate_against_model, validate_config, validate_output_dir,
                            validate_world)


class StageTimer:
    """Wall time per stage, accumulated into ``seconds`` (and time/<stage> metrics)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


def cache_root(cfg: RunConfig) -> Path:
    from dofla.models import cache_root as default_root

    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_root() / "activations"


def load_data(cfg: RunConfig, tokenizer, source=None, train_tokens: int | None = None):
    """(train tokens (S, L), held-out tokens (S', L), data fingerprint); ``source`` is built when not
    given. ``train_tokens`` (default ``data.num_tokens``): how many training tokens to pack here (a
    streaming run packs only the cached sample; the stream reads the rest as it trains)."""
    from dofla.data import build_source, pack_tokens

    source = source or build_source(cfg.data.name, **cfg.data.options)
    L = cfg.data.seq_len
    train = pack_tokens(source.texts("train"), tokenizer, L, train_tokens or cfg.data.num_tokens,
                        desc="tokenize train", source=cfg.data.name)
    heldout = pack_tokens(source.texts("heldout"), tokenizer, L, cfg.data.heldout_tokens,
                          desc="tokenize held-out", source=cfg.data.name, setting="data.heldout_tokens")
    return train, heldout, source.fingerprint()


def log_allocation(tracker, dof: dict | None, dims: list) -> None:
    """The dims as scalars; with Algorithm 1's result (None when it did not run), the DoF per layer
    and the (layer, head, dof, dim) table."""
    tracker.log({"allocation/mean_dim": mean_dim(dims),
                 **{f"allocation/dim/layer_{i:02d}": layer_mean_dim(d) for i, d in enumerate(dims)}})
    if dof is None:
        return
    tracker.log({f"dof/layer_{i:02d}": n for i, n in enumerate(dof["layer_dof"]) if n is not None})
    tracker.log_table("dof_table", ["layer", "head", "dof", "dim"], [
        [i, h, n, d if isinstance(d, int) else d[h]]
        for i, (heads, d) in enumerate(zip(dof["per_head"], dims)) for h, n in enumerate(heads or [])])


def log_training(tracker, summaries: dict) -> None:
    """Per-layer held-out losses as scalars; every layer's training curve as one table."""
    for i, summary in sorted(summaries.items()):
        tracker.log({f"train/layer_{i:02d}/{k}": v for k, v in summary.items() if k.endswith("loss")})
    tracker.log_table("train_curves", ["layer", "step", "loss", "heldout_loss"], [
        [i, point["step"], point.get("loss"), point.get("heldout_loss")]
        for i, summary in sorted(summaries.items()) for point in summary.get("curve", [])])


def check_before_loading(cfg: RunConfig, out_dir: Path):
    """Every check that needs no model: config, world size, run directory, data files, lm-eval tasks.

    Returns (the stages to run, the checked data source, the eval task plan or None).
    """
    from dofla.data import build_source

    validate_config(cfg)
    validate_world(cfg, distributed.world())
    validate_output_dir(out_dir)
    plan = stage_plan(cfg)
    source = build_source(cfg.data.name, **cfg.data.options)  # checks the files exist and are text
    tasks = None
    if cfg.eval.tasks and "eval" in plan and distributed.is_main():
        from dofla.eval.suite import plan_tasks

        others = cfg.eval.perplexity or cfg.eval.attention_error or cfg.eval.mqar
        tasks = plan_tasks(cfg.eval, out_dir, others_requested=others)
    return plan, source, tasks


def _prepare(cfg, plan, timer, teacher, train_tokens, fields, geometry, out_dir):
    """cache -> dof -> allocate, each only when in ``plan``: (cache or None, DoF or None, dims or None).
    ``teacher``: the one whose forwards fill the cache (``capture_teacher``)."""
    from dofla import stages
    from dofla.cache import build_or_load_cache

    cache = dof = dims = None
    if "cache" in plan:
        with timer("cache"):
            cache = build_or_load_cache(teacher, train_tokens, fields, cache_root(cfg))
    if "dof" in plan:
        with timer("dof"):
            dof = distributed.main_first(stages.dof_stage, cfg, cache, out_dir, stages.linear_layers(cfg, geometry))
    if "allocate" in plan:
        with timer("allocate"):
            dims = distributed.main_first(stages.allocate_stage, cfg, dof, geometry, out_dir, cache)
    elif "train" not in plan:  # training-free attention: no feature maps, dims unused
        dims = [0] * geometry.num_layers
    return cache, dof, dims


def cache_fields(cfg: RunConfig, fingerprint: str, num_tokens: int | None = None) -> dict:
    """What determines the activation cache (its key names the data every later artifact came from)."""
    fields = {"model": cfg.model.source, "revision": cfg.model.revision, "data": fingerprint,
              "seq_len": cfg.data.seq_len, "num_tokens": num_tokens or cfg.data.num_tokens, "dtype": "float16"}
    if cfg.model.source.startswith("tiny:"):
        fields["model_seed"], fields["tiny_layers"] = cfg.seed, cfg.model.tiny_layers
    if cfg.train.teacher_dtype != "float32":
        fields["teacher_dtype"] = cfg.train.teacher_dtype
    return fields


def capture_teacher(teacher, dtype: str):
    """The teacher whose forwards produce distillation activations: itself in fp32, else a copy in
    ``dtype`` (the fp32 teacher stays for evaluation and the student)."""
    if dtype == "float32":
        return teacher
    return copy.deepcopy(teacher).to(getattr(torch, dtype))


def run(cfg: RunConfig, out_dir: str | Path, overrides: list[str] = (), tracker=None) -> dict:
    """Run the stages ``stage_plan(cfg)`` names in ``out_dir``; returns the metrics (also in metrics.json)."""
    from dofla.cache import cache_key
    from dofla.models import get_adapter, load_teacher
    from dofla.tracking import NullTracker

    out_dir = Path(out_dir)
    plan, source, tasks = check_before_loading(cfg, out_dir)
    tracker = tracker or NullTracker()
    torch.manual_seed(cfg.seed)
    record = build_record(cfg, overrides)
    timer = StageTimer()
    with timer("load"):
        teacher, tokenizer = load_teacher(cfg.model.source, cfg.model.revision, cfg.seed, cfg.model.tiny_layers)
        teacher = teacher.to(distributed.device(cfg.device))  # the student is a copy: it follows
        geometry = get_adapter(teacher).geometry(teacher.config)
    validate_against_model(cfg, geometry.num_layers, geometry.head_dim, geometry.max_positions)
    needs_capture = "cache" in plan or "train" in plan
    capture = capture_teacher(teacher, cfg.train.teacher_dtype) if needs_capture else teacher
    train_from = choose_train_source(cfg, plan, geometry, capture) if distributed.is_main() else None
    train_from = distributed.broadcast(train_from)
    num_cached = cached_tokens(cfg, train_from)
    with timer("data"):
        train_tokens, heldout_tokens, fingerprint = load_data(cfg, tokenizer, source, num_cached)
    fields = cache_fields(cfg, fingerprint, num_cached)
    record.update(cache_key=cache_key(fields), world_size=distributed.world(), stages=plan, train_source=train_from)
    if distributed.is_main():
        write_json(out_dir / "run.json", record)
    cache, dof, dims = _prepare(cfg, plan, timer, capture, train_tokens, fields, geometry, out_dir)
    if dims is not None:
        log_allocation(tracker, dof, dims)
    if "train" not in plan and "assemble" not in plan:
        return {}
    data = {"cache": cache, "geometry": geometry, "dims": dims, "teacher": teacher, "capture": capture,
            "tokenizer": tokenizer, "train_tokens": train_tokens, "heldout_tokens": heldout_tokens, "cache_key": record["cache_key"],
            "source": train_from}
    return _train_and_evaluate(cfg, plan, timer, data, tasks, tracker, out_dir)


def _train_and_evaluate(cfg, plan, timer, data, tasks, tracker, out_dir: Path) -> dict:
    """train -> assemble -> finetune -> eval -> report, each only when in ``plan``."""
    from dofla import stages
    from dofla.eval.stage import eval_stage
    from dofla.models.card import write_model_card

    main = distributed.is_main()  # under torchrun: rank 0 writes every file, see dofla.distributed
    summaries = {}
    if "train" in plan:
        with timer("train"):
            summaries = stages.train_stage(cfg, data["cache"], data["geometry"], data["dims"], data["teacher"],
                                           data["train_tokens"], out_dir, data["tokenizer"], data["source"],
                                           capture=data["capture"])
        if cfg.loss.name != "direct" and main:
            write_json(out_dir / "train_summary.json", {f"layer_{i:02d}": v for i, v in sorted(summaries.items())})
            log_training(tracker, summaries)
    if cfg.train.layers is not None and len(set(cfg.train.layers)) < data["geometry"].num_layers:
        if main:
            print(f"dofla: trained layers {sorted(set(cfg.train.layers))} into {stages.layer_dir(cfg, out_dir)}; "
                  "run again without train.layers (same train.layer_dir) to assemble and evaluate", flush=True)
        return {}
    if "assemble" not in plan:
        return {}
    with timer("assemble"):
        student = distributed.main_first(stages.assemble_stage, cfg, data["teacher"], data["tokenizer"],
                                         data["dims"], out_dir, data["cache_key"])
    if cfg.finetune.name == "lora" and "finetune" in plan:
        with timer("finetune"):
            student = distributed.main_first(stages.finetune_stage, cfg, student, data["tokenizer"],
                                             data["train_tokens"], out_dir)
    if "eval" not in plan:
        return {}
    with timer("eval"):
        metrics = eval_stage(cfg, data["teacher"], student, data["heldout_tokens"], out_dir, data["tokenizer"],
                             tasks, teacher_scores=cache_root(cfg) / "teacher_scores")
    metrics.update(data_budget(data, summaries))
    if main:
        write_json(out_dir / "metrics.json", metrics)
        evaluated = out_dir / ("student_finetuned" if cfg.finetune.name == "lora" and "finetune" in plan else "student")
        write_model_card(evaluated, metrics, name=str(evaluated))
        _finish(cfg, plan, timer, metrics, tracker, out_dir)
    return metrics


def data_budget(data: dict, summaries: dict) -> dict:
    """``train/tokens``: distinct distillation tokens the features saw (the cached tokens, or the
    tokens streamed); ``cache/bytes``: the activation cache's size on disk (0 without a cache)."""
    if "settings" in summaries:  # direct training's marker: one count for the whole student
        streamed = [summaries["tokens"]] if "tokens" in summaries else []
    else:  # layerwise: per layer (a streamed layer stopped early by patience saw fewer)
        streamed = [s["tokens"] for s in summaries.values() if isinstance(s, dict) and "tokens" in s]
    tokens = max(streamed) if streamed else (data["train_tokens"].numel() if data["source"] == "cache" else 0)
    cache = data["cache"]
    return {"train/tokens": int(tokens), "cache/bytes": int(cache.nbytes()) if cache is not None else 0}


def _finish(cfg, plan, timer, metrics: dict, tracker, out_dir: Path) -> None:
    """Timings, metrics to the tracker, the report and plots, the run summary."""
    from dofla.report import print_run_summary, write_report

    timings = read_json(out_dir / "timings.json") or {}
    timings.update({f"time/{k}": v for k, v in timer.seconds.items()})
    write_json(out_dir / "timings.json", timings)
    tracker.log({**metrics, **timings})
    if "report" in plan:
        write_report(out_dir, console=Console(file=io.StringIO()))
        for plot in sorted(out_dir.glob("*.png")):
            tracker.log_image(plot.stem, plot)
    print_run_summary(out_dir)
