"""Checkpoints and layer artifacts hold tensors and plain values only, load without unpickling code
(torch.load(weights_only=True)), and reach the disk before their name points at them."""
from __future__ import annotations

import builtins
import collections
import json
import logging
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dofla.artifacts import (file_sha256, load_artifact, load_checkpoint, load_plain, plain_problem,
                             save_artifact, torch_save_atomic)

ROOT = Path(__file__).resolve().parents[2]
# torch's weights-only loader notes a bare pickle's protocol before refusing it
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")


class Payload:
    """What a crafted file carries: unpickling it calls open(marker, "w"), creating the marker."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def crafted(path: Path, marker: Path, kind: str) -> None:
    """A file at ``path`` whose unpickling runs code: torch's zip format, or a bare pickle."""
    payload = {"state_dict": {"w": torch.ones(2)}, "meta": {"layer": 0}, "curve": Payload(marker)}
    if kind == "torch":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_the_crafted_payload_runs_when_unpickled_so_the_refusals_below_mean_something(tmp_path, kind):
    marker = tmp_path / "ran"
    crafted(tmp_path / "x.pt", marker, kind)
    if kind == "torch":
        torch.load(tmp_path / "x.pt", weights_only=False)
    else:
        pickle.loads((tmp_path / "x.pt").read_bytes())
    assert marker.exists()


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_a_crafted_artifact_with_a_matching_checksum_is_refused_in_one_sentence_and_never_runs(tmp_path, kind,
                                                                                               caplog):
    path, marker, meta = tmp_path / "layer_00.pt", tmp_path / "ran", {"layer": 0}
    crafted(path, marker, kind)
    # whoever can write the shared directory can write the checksum record as well
    record = {"size": path.stat().st_size, "sha256": file_sha256(path), "meta": meta}
    Path(f"{path}.json").write_text(json.dumps(record))
    with caplog.at_level(logging.INFO, logger="dofla"):
        assert load_artifact(path, meta) is None  # treated as missing: the stage rebuilds it
    assert not marker.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"dofla: refusing artifact {path}:")
    assert lines[0].endswith("rebuilding it") and lines[0].count(". ") == 0


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_a_crafted_checkpoint_is_refused_in_one_sentence_and_never_runs(tmp_path, kind, caplog):
    path, marker = tmp_path / "ckpt.pt", tmp_path / "ran"
    crafted(path, marker, kind)
    with caplog.at_level(logging.INFO, logger="dofla"):
        assert load_checkpoint(path, {"layer": 0}) is None  # the trainer starts over
    assert not marker.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"dofla: refusing checkpoint {path}:")
    assert lines[0].endswith("starting over")


def test_an_artifact_and_a_checkpoint_of_plain_values_load_back_equal(tmp_path):
    state = {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    meta = {"layer": 1, "num_features": [8, 8], "loss": "softmax"}
    save_artifact(tmp_path / "layer_01.pt", {"state_dict": state, "curve": [{"step": 1, "loss": 0.5}]}, meta)
    found = load_artifact(tmp_path / "layer_01.pt", meta)
    assert found["curve"] == [{"step": 1, "loss": 0.5}] and found["meta"] == meta
    assert all(torch.equal(found["state_dict"][k], v) for k, v in state.items())
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    ckpt = {"format": 1, "meta": meta, "optimizers": {"0": opt.state_dict()},
            "rng": {"cpu": torch.get_rng_state(), "cuda": None}, "state": {"step": 3, "seconds": 1.5}}
    torch_save_atomic(ckpt, tmp_path / "ckpt.pt")
    back = load_checkpoint(tmp_path / "ckpt.pt", meta)
    assert back["state"] == ckpt["state"] and torch.equal(back["rng"]["cpu"], ckpt["rng"]["cpu"])
    assert back["optimizers"]["0"]["param_groups"] == opt.state_dict()["param_groups"]


def test_a_layer_artifact_as_the_release_before_wrote_it_still_loads(tmp_path):
    """That release wrote torch.save(payload) to the path and its checksum record beside it: plain values."""
    meta = {"layer": 0, "num_features": 16, "settings": {"loss": "softmax", "lr": 0.01, "betas": [0.9, 0.99]}}
    payload = {"state_dict": collections.OrderedDict(w=torch.randn(4, 8)), "curve": [{"step": 2, "loss": 0.25}],
               "summary": {"final_heldout_loss": 0.2, "stopped_early": False, "best_step": None}, "meta": meta}
    path = tmp_path / "layer_00.pt"
    torch.save(payload, path)
    record = {"size": path.stat().st_size, "sha256": file_sha256(path), "meta": meta}
    Path(f"{path}.json").write_text(json.dumps(record))
    found = load_artifact(path, meta)
    assert found["summary"] == payload["summary"] and torch.equal(found["state_dict"]["w"], payload["state_dict"]["w"])


Point = collections.namedtuple("Point", "x y")
PLAIN = [{"a": [1, 2.5, True, None, "s"]}, (torch.ones(2), torch.Size([2, 3])),
         collections.OrderedDict(w=torch.ones(1)), {"dtype": torch.float16, "device": torch.device("cpu")},
         {3: {"nested": [torch.nn.Parameter(torch.ones(2))]}}]
NOT_PLAIN = [({"x": np.float64(1.0)}, "payload['x'] is a numpy.float64"),
             ({"p": Point(1, 2)}, "payload['p'] is a tests.unit.test_safe_artifacts.Point"),
             ([Payload(Path("unused"))], "payload[0] is a tests.unit.test_safe_artifacts.Payload"),
             ({"a": {np.int64(1): 1}}, "a key of payload['a'] is a numpy.int64")]


@pytest.mark.parametrize("value", PLAIN)
def test_what_the_check_calls_plain_torch_loads_without_unpickling_code(tmp_path, value):
    assert plain_problem(value) is None
    torch.save(value, tmp_path / "v.pt")  # the reference: torch's own weights-only loader
    assert repr(load_plain(tmp_path / "v.pt")) == repr(value)


@pytest.mark.parametrize("value,problem", NOT_PLAIN)
def test_what_the_check_refuses_torch_would_refuse_and_it_is_never_written(tmp_path, value, problem):
    assert plain_problem(value) == problem
    torch.save(value, tmp_path / "v.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_plain(tmp_path / "v.pt")
    with pytest.raises(TypeError, match=re.escape(problem)):
        torch_save_atomic(value, tmp_path / "w.pt")
    assert not (tmp_path / "w.pt").exists() and list(tmp_path.iterdir()) == [tmp_path / "v.pt"]  # no temp left


SAVE = "import sys, torch; from pathlib import Path; from dofla.artifacts import torch_save_atomic; " \
       "torch_save_atomic({'w': torch.ones(1000)}, Path(sys.argv[1]))"


@pytest.mark.slow  # a Python with torch started under strace
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_the_file_is_fsynced_before_its_rename_and_the_directory_after(tmp_path):
    """The system calls themselves, as strace sees them (no stand-in for os.fsync)."""
    target, trace = tmp_path / "d" / "ckpt.pt", tmp_path / "trace.txt"
    env = {"PYTHONPATH": f"{ROOT / 'src'}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["strace", "-f", "--seccomp-bpf", "-o", str(trace), "-e", "trace=openat,fsync,rename,renameat,renameat2",
                           sys.executable, "-c", SAVE, str(target)], env=env, capture_output=True, text=True)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    calls = trace.read_text().splitlines()

    def first(pattern: str, after: int = -1) -> tuple[int, re.Match]:
        return next((i, m) for i, line in enumerate(calls) if i > after and (m := re.search(pattern, line)))

    opened, tmp = first(rf'openat\(AT_FDCWD, "({re.escape(str(target))}\.tmp\w+)", \S*O_CREAT\S*, \d+\) = (\d+)')
    synced, _ = first(rf"fsync\({tmp.group(2)}\b", opened)
    renamed, _ = first(rf'rename\w*\(.*"{re.escape(tmp.group(1))}", .*"{re.escape(str(target))}"', opened)
    dir_opened, directory = first(rf'openat\(AT_FDCWD, "{re.escape(str(target.parent))}", O_RDONLY\S*\) = (\d+)',
                                  renamed)
    dir_synced, _ = first(rf"fsync\({directory.group(1)}\b", dir_opened)
    assert opened < synced < renamed < dir_opened < dir_synced
    assert torch.equal(load_plain(target)["w"], torch.ones(1000))
