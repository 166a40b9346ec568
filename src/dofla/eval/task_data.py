"""The fine-tune protocol's training data: each task's (context, correct continuation) pairs, as
lm-eval builds and tokenises them, and their padding into batches (dofla.eval.task_finetune)."""
from __future__ import annotations

from pathlib import Path

from dofla.eval.downstream import DownstreamUnavailable, manager_for
from dofla.train.continuation_step import pad_batch  # noqa: F401 - API: the fine-tune protocol pads with it


def training_pairs(task: str, model, tokenizer, task_dirs: tuple[str, ...] = (),
                   limit: int | None = None, train_data: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """[(context ids, continuation ids)] of the correct answers in the task's training split(s), or,
    when ``train_data`` is given, in those rows (formatted by the task's first subtask)."""
    from lm_eval.models.huggingface import HFLM  # lazy: lm-eval (the eval extra) takes seconds to import

    leaves = list(manager_for(task, task_dirs).load([task])["tasks"].values())
    encoder = HFLM(pretrained=model, tokenizer=tokenizer)  # lm-eval's own pair tokenisation
    if train_data:
        leaf = leaves[0]  # a group's subtasks (MMLU's 57 subjects) share one prompt format
        return [encoder._encode_pair(*gold_text(leaf, doc, description=False))
                for doc in extra_training_docs(task, train_data, limit)]
    pairs = []
    for leaf in leaves:
        if leaf.has_training_docs():
            for doc in list(leaf.training_docs())[:limit]:
                pairs.append(encoder._encode_pair(*gold_text(leaf, doc)))
    return pairs


def extra_training_docs(task: str, spec: dict, limit: int | None = None) -> list[dict]:
    """The rows of ``spec`` (``{path, name, split}`` on the hub or ``{files: [...]}`` of JSON lines),
    the first ``limit`` of them; one sentence naming the setting when they cannot be read."""
    import datasets  # lazy: datasets (hub data only) takes seconds to import

    problem = train_data_problem(spec, task)
    if problem:
        raise ValueError(problem)
    split = spec.get("split", "train")
    if limit is not None:
        split = f"{split}[:{limit}]"
    try:
        if "files" in spec:
            rows = datasets.load_dataset("json", data_files=[str(Path(p).expanduser()) for p in spec["files"]],
                                         split=split)
        else:
            rows = datasets.load_dataset(spec["path"], spec.get("name"), split=split)
    except Exception as err:  # noqa: BLE001 - offline, missing files, bad names: one sentence
        raise DownstreamUnavailable(
            f"the fine-tune training data of {task} (eval.finetune_train_data.{task}={spec}) cannot be "
            f"read: {str(err).splitlines()[0]}; run once with hub access to cache it, or point it at local files"
        ) from err
    # cais/mmlu's auxiliary_train once nested each row under "train"
    return [row["train"] if set(row) == {"train"} else dict(row) for row in rows]


def gold_text(task, doc, description: bool = True) -> tuple[str, str]:
    """The (context, delimiter + correct choice) pair that lm-eval scores as the right answer;
    ``description=False`` leaves out the task's description (an MMLU subject's "about <subject>"
    line, wrong for rows from other sources)."""
    delimiter = task.config.target_delimiter
    if task.multiple_input:  # winogrande: choices are contexts, doc_to_text is the gold index
        return task.doc_to_choice(doc)[task.doc_to_text(doc)], f"{delimiter}{task.doc_to_target(doc)}"
    choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
    target = target[0] if isinstance(target, list) else target
    if isinstance(target, str) and target not in choices and target.isdigit():
        target = int(target)
    gold = choices[target] if isinstance(target, int) else target
    context = task.fewshot_context(doc, num_fewshot=0) if description else task.doc_to_text(doc)
    return context, f"{delimiter}{gold}"


def train_data_problem(data, task: str | None = None) -> str | None:
    """What is wrong with ``eval.finetune_train_data`` (or, given ``task``, with its entry ``data``
    for that task), in one sentence, or None."""
    if task is None:
        if data is not None and not isinstance(data, dict):
            return f"eval.finetune_train_data={data!r} must map task names to training data, e.g. {{mmlu: {{files: [...]}}}}"
        return next(filter(None, (train_data_problem(spec, t) for t, spec in (data or {}).items())), None)
    spec, key = data, f"eval.finetune_train_data.{task}"
    if (not isinstance(spec, dict) or set(spec) - {"path", "name", "split", "files"}
            or ("path" in spec) == ("files" in spec)):
        return f"{key}={spec} must be {{path, name, split}} (a hub dataset) or {{files: [...]}} (local JSON lines)"
    missing = [str(f) for f in spec.get("files", []) if not Path(f).expanduser().is_file()]
    return f"{key} names files that do not exist: {', '.join(missing)}" if missing else None
