"""The activation cache: contents, reuse, keys, corruption detection, concurrent builders."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dofla.cache import build_or_load_cache, cache_key, predict_cache_bytes, verify_cache
from dofla.models import capture_qkv, get_adapter
from dofla.models.tiny import build_tiny_model

FIELDS = {"model": "tiny:llama", "data": "test", "seq_len": 16, "num_tokens": 96, "dtype": "float16"}


@pytest.fixture
def llama():
    return build_tiny_model("llama")


def _tokens(n=6, length=16):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))


def _count_forwards(model):
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_cache_holds_what_capture_sees(tiny_model, tmp_path):
    tokens = _tokens()
    cache = build_or_load_cache(tiny_model, tokens, FIELDS, tmp_path, batch_size=4, progress=False)
    expected = capture_qkv(tiny_model, tokens)
    g = get_adapter(tiny_model).geometry(tiny_model.config)
    for i, (q, k, v) in enumerate(expected):
        acts = cache.layer(i)
        assert acts.q.dtype == np.float16 and acts.q.shape == (6, g.num_heads, 16, g.head_dim)
        assert acts.k.shape == acts.v.shape == (6, g.num_kv_heads, 16, g.head_dim)
        for stored, exact in zip(acts.torch(), (q, k, v)):
            assert torch.allclose(stored, exact, atol=2e-3, rtol=2e-3)
    data = sum(p.stat().st_size - 128 for p in cache.path.glob("*.npy"))  # .npy headers are 128 bytes
    assert data == predict_cache_bytes(g, 6, 16) == cache.meta["data_bytes"]


def test_second_call_reuses_without_a_teacher_pass(llama, tmp_path):
    first = build_or_load_cache(llama, _tokens(), FIELDS, tmp_path, progress=False)
    calls = _count_forwards(llama)
    second = build_or_load_cache(llama, _tokens(), FIELDS, tmp_path, progress=False)
    assert not calls and second.path == first.path
    assert cache_key({**FIELDS, "seq_len": 32}) != first.key


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_damaged_cache_is_detected_and_rebuilt(llama, tmp_path, damage, capsys):
    cache = build_or_load_cache(llama, _tokens(), FIELDS, tmp_path, progress=False)
    target = cache.path / "layer_01_k.npy"
    original = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(original[: len(original) // 2])
    elif damage == "flip":
        target.write_bytes(original[:300] + bytes(b ^ 0xFF for b in original[300:310]) + original[310:])
    else:
        meta = json.loads((cache.path / "meta.json").read_text())
        meta["fields"]["model"] = "someone-else"
        (cache.path / "meta.json").write_text(json.dumps(meta))
    assert verify_cache(cache.path, FIELDS) is not None
    calls = _count_forwards(llama)
    rebuilt = build_or_load_cache(llama, _tokens(), FIELDS, tmp_path, progress=False)
    assert calls and "not usable" in capsys.readouterr().out
    assert verify_cache(rebuilt.path, FIELDS) is None
    assert (rebuilt.path / "layer_01_k.npy").read_bytes() == original


def test_concurrent_jobs_build_once(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        from dofla.cache import build_or_load_cache
        from dofla.models.tiny import build_tiny_model
        model = build_tiny_model("llama")
        built = []
        model.register_forward_hook(lambda *a: built.append(1))
        tokens = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
        cache = build_or_load_cache(model, tokens, {FIELDS!r}, sys.argv[1], batch_size=1, progress=False)
        print("BUILT" if built else "REUSED", float(torch.from_numpy(cache.layer(1).q[:].astype("float32")).sum()))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=300)[0].split("\n")[-2].split() for p in procs]
    assert sorted(o[0] for o in outputs) == ["BUILT", "REUSED", "REUSED"]
    assert len({o[1] for o in outputs}) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [cache_key(FIELDS)]
