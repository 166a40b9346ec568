"""The model card (README.md) of a saved student: what it is, how it was made, what it measured.

Written by every ``save_pretrained`` from the directory's config.json (teacher, attention form,
feature map, dims; ``dofla_run``, when the pipeline set it: loss, allocation, seed) and written
again by the pipeline after evaluation with the run's metrics (distillation tokens, held-out
perplexity, attention error, task scores) and how its lm-eval scores were made (lm-eval version,
task versions, shots, batch size, limit, the metrics' definitions: :func:`lm_eval_settings`).
The usage snippet names a hub repository or a placeholder path, never the training machine's path.
The front matter is ``huggingface_hub``'s own ``ModelCardData``: the student's scores are its
``model-index`` (``EvalResult``s, which the hub shows as the model's metrics) and its licence is the
teacher's (every weight but the features is the teacher's), read from the teacher's own card.
"""
from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache

from dofla.attention.forms import get_form
from dofla.record import read_json
from dofla.run_files import MEASUREMENTS

CARD_METRICS = (  # (metrics.json key, label), in the card's order
    ("train/tokens", "distillation tokens"),
    ("distill/tokens", "model-level (KL) distillation tokens"),
    ("eval/teacher_ppl", "held-out perplexity, teacher"),
    ("eval/student_ppl", "held-out perplexity, student"),
    ("eval/ppl_ratio", "perplexity ratio (student / teacher)"),
    ("eval/attn_error/mean", "mean attention-output error (per layer, held out)"),
)


# lm-eval's definitions of the two multiple-choice metrics dofla reports (lm_eval.api.task)
METRIC_MEANINGS = (
    ("acc", "the share of questions whose choice of highest log-likelihood is the answer"),
    ("acc_norm", "the same, each choice's log-likelihood divided by its length in characters"),
)


def write_model_card(directory: str | Path, metrics: dict | None = None, name: str | None = None,
                     lm_eval: dict | None = None) -> Path:
    """Write ``directory/README.md``; ``metrics`` (a run's metrics.json) adds the measured rows,
    ``lm_eval`` (:func:`lm_eval_settings`) how its task scores were made, and ``name`` is the hub
    repository the usage snippet loads (anything else, a local path included, gives a placeholder
    path: the directory moves, and the training machine's path means nothing to a reader)."""
    directory = Path(directory)
    metrics = metrics or {}
    config = json.loads((directory / "config.json").read_text())
    spec, run = config["dofla"], config.get("dofla_run") or {}
    teacher = run.get("teacher") or config.get("_name_or_path") or "unknown"
    licence = teacher_license(teacher, run.get("revision"))
    results = eval_results(metrics, lm_eval)
    data = ModelCardData(  # model_name names the model-index entry, needed only with results
        library_name="transformers", tags=["dofla", "linear-attention", "distillation"],
        base_model=teacher if _is_hub_id(teacher) else None, license=licence,
        model_name=_usage_path(name, directory).rpartition("/")[2] if results else None,
        eval_results=results or None)
    licence_cell = f"{licence} (the teacher's)" if licence else "not found: see the teacher's own card"
    lines = [
        f"# Linear-attention student of {teacher}", "",
        "Made with dofla: the teacher's softmax attention replaced by linear attention whose features were "
        "distilled from the teacher (Nishikawa, Higuchi & Suzuki, NeurIPS 2025), every other weight the "
        "teacher's.", "",
        "| | |", "|---|---|",
        f"| teacher | {teacher} ({config.get('teacher_model_type', config.get('model_type'))}) |",
        f"| attention | {_attention(spec)} |",
        f"| feature map | {spec.get('feature_map')} |",
        f"| feature dims per layer | {_dims(spec['dims'])} |",
        f"| licence | {licence_cell} |",
        *[f"| {label} | {run[key]} |" for key, label in (("loss", "distillation loss"),
                                                          ("allocation", "dims allocation"),
                                                          ("seed", "seed")) if key in run],
        *_metric_rows(metrics),
        *_lm_eval_section(metrics, lm_eval),
        "", "## Use", "",
        "Needs the dofla package installed (the student's attention is its code):", "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{_usage_path(name, directory)}", '
        "trust_remote_code=True)",
        "```", "",
        *([] if name and _is_hub_id(name) else
          [f"`{_usage_path(name, directory)}` stands for this directory (the one holding this card) "
           "wherever it lies, or its hub repository id.", ""]),
        "Decoding keeps a fixed-size recurrent state per linear layer (no growing key/value cache for them).",
        "",
    ]
    path = directory / "README.md"
    # ModelCard parses what it is given: a front matter the hub could not read fails here, not on the hub
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)).save(path)
    return path


def _attention(spec: dict) -> str:
    """The card's attention row: a per-head plan when the saved plan has a layer whose heads differ, else
    the form's wording from its traits (its state, its window)."""
    if _heads_differ(spec.get("plan") or []):
        return _plan_summary(spec["plan"])
    attention, kept = spec.get("attention", "linear"), spec.get("softmax_layers") or []
    if spec.get("feature_map") == "softmax":
        return "exact softmax (reference)"
    exact = (f"; layers {', '.join(map(str, kept))} exact softmax (they keep a key/value cache when decoding)"
             if kept else "")
    gate = ", with a per-head decay gate on the state" if spec.get("gate", "none") != "none" else ""
    if spec.get("linear_scale", "fixed") == "learned":
        gate += ", weighted against the window by a learned per-head scale"
    state, window = get_form(attention).traits.state, spec.get("window")
    if not window and state == "additive":
        return ("linear (every global layer)" if not kept else "linear") + gate + exact
    if not window and state == "delta":
        return "gated delta rule (every global layer)" + exact
    before = {"additive": ", linear attention before" + gate, "delta": ", a gated-delta state before"}.get(state, "")
    return f"{attention}: exact softmax over the last {window} tokens and {spec.get('sinks', 0)} sinks" + before + exact


def _heads_differ(plan: list) -> bool:
    return any(len({json.dumps(head, sort_keys=True) for head in layer}) > 1 for layer in plan)


def _plan_summary(plan: list) -> str:
    """How many KV heads keep what: exact, a window (with sinks), a linear state of M, or a window and a state."""
    counts: dict[str, int] = {}
    for layer in plan:
        for head in layer:
            counts[_head_words(head)] = counts.get(_head_words(head), 0) + 1
    total = sum(counts.values())
    return (f"a plan per key/value head ({total} heads in {len(plan)} layers): "
            + "; ".join(f"{n} {what}" for what, n in counts.items()))


def _head_words(head: dict) -> str:
    window, state, m = head.get("window", 0), head.get("state", "none"), head.get("M", 0)
    if window == "all":
        return "exact (a key/value cache)"
    sinks = f" and {head['sinks']} sinks" if head.get("sinks") else ""
    parts = [f"a window of {window} tokens{sinks}"] if window else []
    if state != "none":
        parts.append(f"{'an additive' if state == 'additive' else 'a gated-delta'} state of M={m}"
                     + (" with a decay gate" if head.get("gate", "none") != "none" else ""))
    return f"{parts[0]} with {parts[1]} before it" if len(parts) == 2 else parts[0]


def _dims(dims: list) -> str:
    flat = [d if isinstance(d, int) else sum(d) / len(d) for d in dims]
    mean = sum(flat) / len(flat) if flat else 0
    return f"{' '.join(str(d) for d in dims)} (mean {mean:.1f})"


def _metric_rows(metrics: dict) -> list[str]:
    return [f"| {label} | {_fmt(metrics[key])} |" for key, label in CARD_METRICS if key in metrics]


def lm_eval_settings(run_dir: str | Path, metrics: dict) -> dict | None:
    """How the run's zero-shot lm-eval scores of the student were made, read from the settings its
    eval stage stored them under (``eval_measurements.json``): ``{"lm_eval": version, "tasks",
    "limit", "batch_size"}``; None when the run scored no task. The entry is the one whose scores
    are the run's (the store keeps earlier settings' entries too)."""
    entries = read_json(Path(run_dir) / MEASUREMENTS) or {}
    for key, entry in sorted(entries.items()):
        scores = entry.get("metrics") or {}
        if key.startswith("tasks/student-") and scores and all(metrics.get(k) == v for k, v in scores.items()):
            return {k: entry["settings"].get(k) for k in ("lm_eval", "tasks", "limit", "batch_size")}
    return None


def _task_scores(metrics: dict, who: str) -> dict[str, dict]:
    """{task: {metric: value}} of ``tasks/<who>/<task>/<metric>`` (avg_acc left out)."""
    scores: dict[str, dict] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[:2] == ["tasks", who]:
            scores.setdefault(parts[2], {})[parts[3]] = value
    return scores


def _lm_eval_section(metrics: dict, lm_eval: dict | None) -> list[str]:
    """The task scores with what makes them comparable: lm-eval and task versions, shots, metric,
    batch size and limit. Task versions are read from ``tasks/student/<task>/version`` when the run
    recorded them."""
    student, teacher = _task_scores(metrics, "student"), _task_scores(metrics, "teacher")
    if not student:
        return []
    settings = lm_eval or {}
    limit = settings.get("limit")
    lines = ["", "## lm-eval scores", "",
             f"lm-eval {settings.get('lm_eval') or '(version not recorded)'}, "
             "`lm_eval.simple_evaluate` on the model in memory, zero-shot (`num_fewshot=0`), "
             f"batch size {settings.get('batch_size') or '(not recorded)'}, "
             + (f"the first {limit} documents of each task" if limit else
                "every document of each task" if lm_eval else "documents per task not recorded")
             + ", no bootstrap.", "",
             "| task | task version | metric | student | teacher |", "|---|---|---|---|---|"]
    known = [m for m, _ in METRIC_MEANINGS]
    shown = set()
    for task, scores in sorted(student.items()):
        theirs = teacher.get(task, {})
        # acc and acc_norm first, then whatever else the task reports (a recall task's per-length scores)
        for metric in sorted((m for m in scores if m != "version"), key=lambda m: (m not in known, known.index(m)
                                                                                   if m in known else 0, m)):
            shown.add(metric)
            lines.append(f"| {task} | {scores.get('version', 'not recorded')} | `{metric}` | {_fmt(scores[metric])} | "
                         f"{'–' if metric not in theirs else _fmt(theirs[metric])} |")
    lines += ["", *(f"- `{metric}`: {meaning}." for metric, meaning in METRIC_MEANINGS if metric in shown)]
    if shown - set(known):
        lines.append("- any other metric: the task's own score under lm-eval's name (`,filter` names a filter other "
                     "than none; a number is the context length a recall task's score was taken at).")
    return lines


def _usage_path(name: str | None, directory: Path) -> str:
    """A hub id as given; otherwise a placeholder named after the directory (never a local path)."""
    return name if name and _is_hub_id(name) else f"path/to/{directory.name}"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def teacher_license(teacher: str, revision: str | None = None) -> str | None:
    """The licence in the teacher's own model card: a local directory's README.md, or a hub
    repository's as the local Hugging Face cache holds it (no download: cards are written offline too)."""
    local = Path(teacher).expanduser() / "README.md"
    if local.is_file():
        path = local
    elif _is_hub_id(teacher):
        path = try_to_load_from_cache(teacher, "README.md", revision=revision)
        if not isinstance(path, str):  # None (never fetched) or a marker of a file the repo lacks
            return None
    else:
        return None
    try:
        return ModelCard.load(path, ignore_metadata_errors=True).data.license
    except Exception:  # a card whose front matter does not parse states no licence
        return None


def eval_results(metrics: dict, lm_eval: dict | None) -> list[EvalResult]:
    """The student's measured scores as the hub's ``model-index``: its held-out perplexity and each
    lm-eval task's acc / acc_norm (zero-shot, as :func:`_lm_eval_section` states)."""
    results = []
    if "eval/student_ppl" in metrics:
        results.append(EvalResult(task_type="text-generation", dataset_type="held-out",
                                  dataset_name="held-out text of the distillation data",
                                  metric_type="perplexity", metric_value=metrics["eval/student_ppl"]))
    version = (lm_eval or {}).get("lm_eval")
    for task, scores in sorted(_task_scores(metrics, "student").items()):
        for metric, _ in METRIC_MEANINGS:
            if metric in scores:
                results.append(EvalResult(
                    task_type="text-generation", dataset_type=task, dataset_name=task,
                    dataset_args={"num_fewshot": 0}, metric_type=metric, metric_value=scores[metric],
                    metric_name=f"{metric} (lm-eval {version})" if version else metric))
    return results
