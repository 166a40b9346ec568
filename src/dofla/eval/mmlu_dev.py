"""An offline MMLU task built from the real MMLU dev questions that lm-eval ships in its YAMLs.

lm-eval's ``mmlu/flan_cot_fewshot/mmlu_<subject>.yaml`` files embed each subject's dev questions
as few-shot samples: ``question`` ends with "(A) .. (B) .. (C) .. (D) .." and ``target`` ends with
"The answer is (X).". Parsing them gives ~280 genuine MMLU questions with no network, enough for
a small but real multiple-choice check when ``cais/mmlu`` cannot be downloaded.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

MMLU_DEV_TASK = "mmlu_dev_offline"
LETTERS = "ABCD"
# Greedy stem: the choice block is the last line starting "(A)", so "(A)" inside a stem is kept.
QUESTION_RE = re.compile(r"^(?P<stem>.*)\n\s*\(A\)(?P<A>.*?)\(B\)(?P<B>.*?)\(C\)(?P<C>.*?)\(D\)(?P<D>.*)$",
                         re.S)
ANSWER_RE = re.compile(r"answer is \(([A-Z])\)\.?\s*$")

TASK_YAML = {
    "task": MMLU_DEV_TASK,
    "dataset_path": "json",
    "output_type": "multiple_choice",
    "test_split": "test",
    # Choice texts as continuations (not lm-eval's A/B/C/D letters), so acc_norm is meaningful too.
    "doc_to_text": "{{question}}\nAnswer:",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "answer",
    "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                    for m in ("acc", "acc_norm")],
    "metadata": {"version": 1.0},
}


def flan_cot_dir() -> Path:
    import lm_eval  # lazy: lm-eval (the eval extra) takes seconds to import

    return Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "flan_cot_fewshot"


def parse_sample(sample: dict) -> dict | None:
    """{question, choices[4], answer index} from one flan-CoT sample, or None if it does not parse."""
    question, target = sample.get("question"), sample.get("target")
    if not isinstance(question, str) or not isinstance(target, str):
        return None
    match, answer = QUESTION_RE.match(question.strip()), ANSWER_RE.search(target.strip())
    if match is None or answer is None or answer.group(1) not in LETTERS:
        return None
    choices = [" ".join(match.group(k).split()) for k in LETTERS]
    if not all(choices) or "(E)" in match.group("D"):  # five-option questions are not MMLU-shaped
        return None
    return {"question": match.group("stem").strip(), "choices": choices,
            "answer": LETTERS.index(answer.group(1))}


def mmlu_dev_questions(source_dir: Path | None = None) -> tuple[list[dict], int]:
    """(parsed questions with their subject, number of samples skipped as unparseable)."""
    docs, skipped, seen = [], 0, set()
    for path in sorted((source_dir or flan_cot_dir()).glob("mmlu_*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        subject = cfg.get("dataset_name", path.stem.removeprefix("mmlu_"))
        for sample in (cfg.get("fewshot_config") or {}).get("samples") or []:
            doc = parse_sample(sample)
            if doc is None:
                skipped += 1
            elif doc["question"] not in seen:
                seen.add(doc["question"])
                docs.append({"subject": subject, **doc})
    return docs, skipped


def write_mmlu_dev_task(target_dir: str | Path) -> str:
    """Write ``mmlu_dev_offline.yaml`` + its JSONL into ``target_dir``; returns the task name."""
    target = Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    docs, skipped = mmlu_dev_questions()
    if not docs:
        raise RuntimeError(f"no MMLU dev questions could be parsed from {flan_cot_dir()}")
    data = target / f"{MMLU_DEV_TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = {**TASK_YAML, "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
              "metadata": {"version": 1.0, "num_docs": len(docs), "unparsed": skipped}}
    (target / f"{MMLU_DEV_TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return MMLU_DEV_TASK
