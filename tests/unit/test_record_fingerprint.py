"""The run record's fingerprint (machine, torch build, threads), its dirty-tree mark, and the embedded
teacher's conversion keyed by the GGUF file's hash."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from dofla.artifacts import file_sha256
from dofla.config import RunConfig
from dofla.eval.suite import TaskPlan, teacher_file
from dofla.models import loading
from dofla.models.loading import EMBEDDED, _embedded_gguf_path, converted_dir, gguf_sha256, teacher_identity
from dofla.record import git_state, torch_build
from dofla.stages.keys import cache_fields, teacher_settings


def test_the_fingerprint_names_the_torch_build_and_the_threads_in_use():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch_build()
        assert one["threads"] == 1 and one["torch"] == torch.__version__
    finally:
        torch.set_num_threads(before)
    shown = torch.__config__.show()
    assert f"BLAS_INFO={one['blas']}" in shown and f"LAPACK_INFO={one['lapack']}" in shown
    assert one["onednn_build"] is None or one["onednn_build"] in shown
    assert one["blas_build"] is None or one["blas_build"] in shown
    assert one["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert one["mkldnn"] == (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    assert isinstance(one["cpu"], str) and one["cpu"]


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_a_tree_with_uncommitted_changes_is_marked_with_the_changed_paths(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("outputs/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    clean = git_state(repo)
    assert len(clean["sha"]) == 40 and clean["dirty"] is False and clean["changed"] == []
    (repo / "outputs").mkdir()
    (repo / "outputs" / "run.json").write_text("{}")  # ignored: not a change to the code
    assert git_state(repo)["dirty"] is False
    (repo / "docs" / "runs").mkdir(parents=True)  # a record or a page a reproduction script writes: listed, not dirty
    (repo / "docs" / "runs" / "metrics.json").write_text("{}")
    (repo / "NOTES.md").write_text("n\n")
    docs_only = git_state(repo)
    assert docs_only["dirty"] is False and docs_only["changed"] == ["NOTES.md", "docs/"]
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    dirty = git_state(repo)
    assert dirty["dirty"] is True and dirty["changed"] == ["NOTES.md", "a.py", "docs/", "new.py"] and dirty["sha"] == clean["sha"]
    (repo / "docs" / "runs" / "metrics.json").write_text('{"l": 1}')
    assert git_state(repo)["diff_sha256"] == dirty["diff_sha256"]  # a record's change is not the code's
    (repo / "a.py").write_text("x = 3\n")
    assert git_state(repo)["diff_sha256"] != dirty["diff_sha256"]  # another edit, another hash
    assert git_state(repo / "docs")["dirty"] is True  # from a subfolder, the whole tree
    assert git_state(tmp_path)["sha"] is None  # not a git tree


def test_the_conversion_is_keyed_by_the_gguf_content_and_the_hash_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DOFLA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "a" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    copy = tmp_path / "b" / gguf.name
    copy.parent.mkdir()
    shutil.copy2(gguf, copy)
    assert gguf_sha256(gguf) == file_sha256(gguf)
    assert converted_dir(copy) == converted_dir(gguf)  # the same content elsewhere: the same conversion
    assert converted_dir(gguf).name == f"smollm2-135m-instruct.q4_1-{file_sha256(gguf)[:16]}"
    changed = bytearray(copy.read_bytes())
    changed[100] ^= 1
    stat = copy.stat()
    copy.write_bytes(bytes(changed))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # same path, size and time: the kept hash is read, not the file (the cache is what later loads cost)
    assert gguf_sha256(copy) == file_sha256(gguf)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a changed file has a new time
    assert gguf_sha256(copy) == file_sha256(copy) != file_sha256(gguf)
    assert converted_dir(copy) != converted_dir(gguf)


@pytest.mark.parametrize("name", [EMBEDDED, "tiny:llama"])
def test_the_record_names_the_teacher_and_the_embedded_ones_file_hash(name, tmp_path, monkeypatch):
    monkeypatch.setenv("DOFLA_CACHE_DIR", str(tmp_path))
    identity = teacher_identity(name)
    assert identity["source"] == name
    if name == EMBEDDED:
        assert identity["sha256"] == file_sha256(_embedded_gguf_path())
        assert "Q4_1" in identity["weights"] and "dequantised to float32" in identity["weights"]
        assert identity["file"].endswith(".Q4_1.gguf")


def test_another_embedded_gguf_changes_every_key_the_teacher_enters(tmp_path, monkeypatch):
    """The file the keys were made from leaves them as they were; a new file (another package release)
    gives the activation cache, the teacher's scores and its task scores keys of their own."""
    monkeypatch.setenv("DOFLA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = RunConfig()
    cfg.model.source = EMBEDDED
    assert file_sha256(_embedded_gguf_path()) == loading.EMBEDDED_SHA256
    assert loading.weights_fields(EMBEDDED) == {} and loading.weights_fields("tiny:llama") == {}
    plan = TaskPlan(runnable=["hellaswag"], skipped={}, task_dirs=())
    before = cache_fields(cfg, "text"), teacher_settings(cfg), teacher_file(tmp_path, plan, cfg, "teacher_tasks")
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"GGUF another release")
    monkeypatch.setattr(loading, "_embedded_gguf_path", lambda: other)
    assert loading.weights_fields(EMBEDDED) == {"weights_sha256": file_sha256(other)}
    after = cache_fields(cfg, "text"), teacher_settings(cfg), teacher_file(tmp_path, plan, cfg, "teacher_tasks")
    assert all(a != b for a, b in zip(after, before))
    assert after[0]["weights_sha256"] == after[1]["weights_sha256"] == file_sha256(other)
