"""Shared fixtures: tiny random models of the three architectures, built locally, never downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from dofla.models.tiny import TINY_ARCHITECTURES, build_byte_tokenizer, build_tiny_model

torch.set_num_threads(min(2, torch.get_num_threads()))

# Every test runs offline as far as trackers and tokenizer threads go; the subprocesses the tests
# start inherit this environment. Tests that need the hub offline set their own caches as well.
# Folders under a cache root that are not activation caches: the prepared corpus and the store of the
# teacher's measurements and its KL targets that every run on the same text shares.
SHARED_CACHE_FOLDERS = ("prepared", "teacher_scores", "teacher_logits")


def activation_caches(root: Path) -> list[Path]:
    """The activation caches under a cache root (one folder per cache key)."""
    if not root.exists():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name not in SHARED_CACHE_FOLDERS]


OFFLINE_ENVIRONMENT = {"WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="session", autouse=True)
def offline_environment():
    before = {key: os.environ.get(key) for key in OFFLINE_ENVIRONMENT}
    for key, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    """Tiers: everything in tests/integration (the CLI, launchers, torchrun, the embedded model) is
    ``slow``; ``gpu`` tests are skipped where CUDA is not available."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():  # not keywords: a checkout in a folder named gpu
            item.add_marker(no_gpu)


@pytest.fixture(params=TINY_ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return build_tiny_model(arch, seed=0)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()


# Local lm-eval tasks in the same prompt/choice/target fields as lm-eval's piqa.yaml and
# arc_easy.yaml, on JSON files the tests write: the downstream path runs offline for real.
ACC_METRICS = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]
SCHEMAS = {
    "piqa_local": {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
                   "doc_to_choice": "{{[sol1, sol2]}}"},
    "arc_local": {"doc_to_text": "Question: {{question}}\nAnswer:",
                  "doc_to_target": "{{choices.label.index(answerKey)}}",
                  "doc_to_choice": "{{choices.text}}"},
}


def _piqa_doc(i: int) -> dict:
    return {"goal": f"To warm cup {i},", "sol1": "heat it.", "sol2": "freeze it.", "label": i % 2}


def _arc_doc(i: int) -> dict:
    return {"question": f"What is {i} plus one?", "answerKey": "ABCD"[i % 4],
            "choices": {"text": [str(i + 1 + k) for k in range(4)], "label": list("ABCD")}}


def write_local_tasks(root: Path) -> Path:
    """piqa_local and arc_local (train 12 / validation 10 docs each) as lm-eval YAML + JSONL in ``root``."""
    for name, make in (("piqa_local", _piqa_doc), ("arc_local", _arc_doc)):
        files = {}
        for split, n in (("train", 12), ("validation", 10)):
            files[split] = str(root / f"{name}_{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(make(i)) + "\n" for i in range(n)))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
                  "output_type": "multiple_choice", "training_split": "train",
                  "validation_split": "validation", "metric_list": ACC_METRICS, **SCHEMAS[name]}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return root
