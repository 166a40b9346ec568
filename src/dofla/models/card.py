"""The model card (README.md) of a saved student: what it is, how it was made, what it measured.

Written by every ``save_pretrained`` from the directory's config.json (teacher, attention form,
feature map, dims; ``dofla_run``, when the pipeline set it: loss, allocation, seed) and written
again by the pipeline after evaluation with the run's metrics (distillation tokens, held-out
perplexity, attention error, task scores).
"""
from __future__ import annotations

import json
from pathlib import Path

CARD_METRICS = (  # (metrics.json key, label), in the card's order
    ("train/tokens", "distillation tokens"),
    ("distill/tokens", "model-level (KL) distillation tokens"),
    ("eval/teacher_ppl", "held-out perplexity, teacher"),
    ("eval/student_ppl", "held-out perplexity, student"),
    ("eval/ppl_ratio", "perplexity ratio (student / teacher)"),
    ("eval/attn_error/mean", "mean attention-output error (per layer, held out)"),
)


def write_model_card(directory: str | Path, metrics: dict | None = None, name: str | None = None) -> Path:
    """Write ``directory/README.md``; ``metrics`` (a run's metrics.json) adds the measured rows and
    ``name`` is what the usage snippet loads (default: a placeholder, the directory may move)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    spec, run = config["dofla"], config.get("dofla_run") or {}
    teacher = run.get("teacher") or config.get("_name_or_path") or "unknown"
    lines = [
        "---", "library_name: transformers", "tags: [dofla, linear-attention, distillation]",
        *([f"base_model: {teacher}"] if _is_hub_id(teacher) else []), "---", "",
        f"# Linear-attention student of {teacher}", "",
        "Made with dofla: the teacher's softmax attention replaced by linear attention whose features were "
        "distilled from the teacher (Nishikawa, Higuchi & Suzuki, NeurIPS 2025), every other weight the "
        "teacher's.", "",
        "| | |", "|---|---|",
        f"| teacher | {teacher} ({config.get('teacher_model_type', config.get('model_type'))}) |",
        f"| attention | {_attention(spec)} |",
        f"| feature map | {spec.get('feature_map')} |",
        f"| feature dims per layer | {_dims(spec['dims'])} |",
        *[f"| {label} | {run[key]} |" for key, label in (("loss", "distillation loss"),
                                                          ("allocation", "dims allocation"),
                                                          ("seed", "seed")) if key in run],
        *_metric_rows(metrics or {}),
        "", "## Use", "",
        "Needs the dofla package installed (the student's attention is its code):", "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{name or "<this directory or hub repository>"}", '
        "trust_remote_code=True)",
        "```", "",
        "Decoding keeps a fixed-size recurrent state per linear layer (no growing key/value cache for them).",
        "",
    ]
    path = directory / "README.md"
    path.write_text("\n".join(lines))
    return path


def _attention(spec: dict) -> str:
    attention, kept = spec.get("attention", "linear"), spec.get("softmax_layers") or []
    if spec.get("feature_map") == "softmax":
        return "exact softmax (reference)"
    exact = (f"; layers {', '.join(map(str, kept))} exact softmax (they keep a key/value cache when decoding)"
             if kept else "")
    gate = ", with a per-head decay gate on the state" if spec.get("gate", "none") != "none" else ""
    if spec.get("linear_scale", "fixed") == "learned":
        gate += ", weighted against the window by a learned per-head scale"
    if attention == "linear":
        return ("linear (every global layer)" if not kept else "linear") + gate + exact
    if attention == "gated_delta" and not spec.get("window"):
        return "gated delta rule (every global layer)" + exact
    return f"{attention}: exact softmax over the last {spec.get('window')} tokens and {spec.get('sinks', 0)} sinks" + (
        ", linear attention before" + gate if attention == "hybrid" else
        ", a gated-delta state before" if attention == "gated_delta" else "") + exact


def _dims(dims: list) -> str:
    flat = [d if isinstance(d, int) else sum(d) / len(d) for d in dims]
    mean = sum(flat) / len(flat) if flat else 0
    return f"{' '.join(str(d) for d in dims)} (mean {mean:.1f})"


def _metric_rows(metrics: dict) -> list[str]:
    rows = [f"| {label} | {_fmt(metrics[key])} |" for key, label in CARD_METRICS if key in metrics]
    rows += [f"| {key.removeprefix('tasks/student/')} (lm-eval) | {_fmt(value)} |"
             for key, value in sorted(metrics.items()) if key.startswith("tasks/student/")]
    return rows


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))
