"""A saved student is itself outside dofla: plain transformers (remote code), lm-eval's CLI, a hub
push, a model card; directories saved before the export format still load."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dofla.models import convert, load_student
from dofla.models.tiny import build_tiny_model
from tests.conftest import write_local_tasks

PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
directory, mode = sys.argv[1], sys.argv[2]
if mode == "no_dofla":
    sys.modules["dofla"] = None  # as if dofla were not installed
try:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=mode != "untrusted")
except Exception as error:
    print("ERROR:", type(error).__name__, " ".join(str(error).split()))
    sys.exit(0)
ids = torch.load(sys.argv[3])
torch.save(model(ids, use_cache=False).logits, sys.argv[4])
print("LOADED:", type(model).__name__)
"""


def _env(tmp_path: Path) -> dict:
    # remote code is copied into HF_HOME/modules: keep it inside the test's own directory
    return {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error"}


def _student(arch: str = "llama", gate: str = "none"):
    teacher = build_tiny_model(arch, seed=0)
    student = convert(build_tiny_model(arch, seed=0), feature_map="learned_prf", dims=[6, 4], gate=gate)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if ".dofla." in name:  # the features (and gates) as if trained: not their initial values
                p.add_(0.05 * torch.randn_like(p))
                if name.endswith("gate.alpha"):  # a gate decays: α ≥ 0
                    p.abs_()
    return teacher, student.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(1))


def _plain_load(tmp_path: Path, directory: Path, mode: str):
    ids_path, out_path = tmp_path / "ids.pt", tmp_path / f"logits_{mode}.pt"
    torch.save(_ids(), ids_path)
    result = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(directory), mode, str(ids_path), str(out_path)],
                            capture_output=True, text=True, env=_env(tmp_path), stdin=subprocess.DEVNULL,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERROR:", "LOADED:"))]
    return lines[-1], (torch.load(out_path) if out_path.exists() else None)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_transformers_loads_the_student_never_the_teacher(arch, tmp_path, byte_tokenizer):
    teacher, student = _student(arch)
    student.save_pretrained(tmp_path / "student")
    with torch.no_grad():
        expected, teachers = student(_ids(), use_cache=False).logits, teacher(_ids()).logits
    assert not torch.allclose(expected, teachers, atol=1e-3)

    line, logits = _plain_load(tmp_path, tmp_path / "student", "trusted")
    assert line.startswith("LOADED: Linear")
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    line, logits = _plain_load(tmp_path, tmp_path / "student", "untrusted")
    assert logits is None and "trust_remote_code=True" in line
    line, logits = _plain_load(tmp_path, tmp_path / "student", "no_dofla")
    assert logits is None and line.startswith("ERROR: ImportError") and "install dofla" in line


def test_plain_transformers_loads_a_gated_student_with_its_gates(tmp_path):
    _, student = _student(gate="scalar")
    student.save_pretrained(tmp_path / "student")
    with torch.no_grad():
        expected = student(_ids(), use_cache=False).logits
        for attn in student.student_attentions():
            attn.gate.alpha.zero_()
        closed = student(_ids(), use_cache=False).logits
    assert not torch.allclose(expected, closed, atol=1e-4)  # the saved gates matter
    line, logits = _plain_load(tmp_path, tmp_path / "student", "trusted")
    assert line.startswith("LOADED: Linear")
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_directories_saved_before_the_export_format_still_load(tmp_path):
    _, student = _student()
    student.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())  # the old form: the teacher's type + dofla
    config["model_type"] = config.pop("teacher_model_type")
    config["architectures"] = ["LinearLlamaForCausalLM"]
    for key in ("auto_map", "teacher_architectures"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = load_student(tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(_ids(), use_cache=False).logits, student(_ids(), use_cache=False).logits)


class LocalHub:
    """Stands in for the hub's HTTP API: a repository is a folder under ``root``."""

    root: Path

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=None, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)
        return f"local://{repo_id}"


def test_push_to_hub_uploads_the_exported_student_with_its_card(tmp_path, monkeypatch):
    import huggingface_hub

    _, student = _student()
    student.config.dofla_run = {"teacher": "tiny/llama", "loss": "softmax", "allocation": "dof", "seed": 0}
    LocalHub.root = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub, "HfApi", LocalHub)
    assert student.push_to_hub("someone/tiny-student") == "local://someone/tiny-student"
    repo = tmp_path / "hub" / "someone" / "tiny-student"
    card = (repo / "README.md").read_text()
    assert "base_model: tiny/llama" in card and "| feature dims per layer | 6 4 (mean 5.0) |" in card
    assert "| distillation loss | softmax |" in card
    line, logits = _plain_load(tmp_path, repo, "trusted")
    with torch.no_grad():
        torch.testing.assert_close(logits, student(_ids(), use_cache=False).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.long  # lm-eval's own CLI in a subprocess (a minute); the in-process scoring runs by default
def test_lm_eval_cli_scores_the_saved_student(tmp_path, byte_tokenizer):
    """``lm_eval --model hf --model_args pretrained=<dir>,trust_remote_code=True`` gives the
    student's log-likelihoods (compared request by request with the in-memory student's)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    teacher, student = _student()
    student.save_pretrained(tmp_path / "student")
    byte_tokenizer.save_pretrained(tmp_path / "student")
    (tmp_path / "tasks").mkdir()
    tasks = write_local_tasks(tmp_path / "tasks")
    out = tmp_path / "lm_eval_out"
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={tmp_path / 'student'},trust_remote_code=True", "--tasks", "piqa_local",
               "--include_path", str(tasks), "--device", "cpu", "--batch_size", "4", "--log_samples",
               "--output_path", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (samples_file,) = out.rglob("samples_piqa_local_*.jsonl")
    cli = [json.loads(line)["resps"] for line in samples_file.read_text().splitlines()]

    def in_memory(model) -> list:
        from lm_eval.tasks import TaskManager

        lm = HFLM(pretrained=model, tokenizer=byte_tokenizer, batch_size=4)
        run = simple_evaluate(model=lm, tasks=["piqa_local"], log_samples=True,
                              task_manager=TaskManager(include_path=str(tasks)))
        return [sample["resps"] for sample in run["samples"]["piqa_local"]]

    def loglikelihoods(resps: list) -> torch.Tensor:
        return torch.tensor([[float(choice[0][0]) for choice in doc] for doc in resps])

    expected, teachers = loglikelihoods(in_memory(student)), loglikelihoods(in_memory(teacher))
    torch.testing.assert_close(loglikelihoods(cli), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(loglikelihoods(cli), teachers, atol=1e-2)


TOKENIZER_LOAD = """
import sys
from transformers import AutoTokenizer
from dofla.models import load_student_tokenizer
tokenizer = load_student_tokenizer(sys.argv[1]) if sys.argv[2] == "dofla" else AutoTokenizer.from_pretrained(sys.argv[1])
print("IDS:", tokenizer("ab")["input_ids"])
"""


def test_the_saved_tokenizer_loads_without_asking_to_run_remote_code(tmp_path, byte_tokenizer):
    _, student = _student("llama")
    student.save_pretrained(tmp_path / "student")
    byte_tokenizer.save_pretrained(tmp_path / "student")
    outputs = {}
    for how in ("dofla", "plain"):
        result = subprocess.run([sys.executable, "-c", TOKENIZER_LOAD, str(tmp_path / "student"), how],
                                capture_output=True, text=True, env=_env(tmp_path), stdin=subprocess.DEVNULL,
                                timeout=300)
        outputs[how] = result.stdout + result.stderr
    assert f"IDS: {byte_tokenizer('ab')['input_ids']}" in outputs["dofla"]
    assert "custom code" not in outputs["dofla"]
    assert "custom code" in outputs["plain"]  # what AutoTokenizer alone does with the student's model type
