"""The activation cache: the teacher's post-RoPE q, k, v per layer, fp16, memory-mapped.

One teacher pass over the distillation tokens, stored under ``root/<key>`` where the key hashes
everything that determines the activations (model + revision, data, seq_len, tokens, dtype,
format version). A sweep of many runs builds it once. The build writes into a temporary
directory and renames it into place, under an inter-process lock, with a manifest of sizes and
checksums; a truncated, corrupted or foreign cache is reported in one sentence and rebuilt.

Per layer: ``layer_XX_q.npy`` (S, H, L, d), ``layer_XX_k.npy`` / ``layer_XX_v.npy``
(S, H_kv, L, d): keys and values once per KV head for GQA models.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm

from dofla import distributed
from dofla.artifacts import file_sha256
from dofla.errors import DoflaError
from dofla.faults import kill_point
from dofla.models.adapters import AttentionGeometry, get_adapter
from dofla.models.capture import capturing

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("q", "k", "v")


class CacheError(DoflaError, RuntimeError):
    """The cache cannot be built (e.g. not enough disk); the message says what to do."""


def cache_key(fields: dict) -> str:
    payload = json.dumps({**fields, "format_version": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def predict_cache_bytes(geometry: AttentionGeometry, num_seqs: int, seq_len: int) -> int:
    """Data bytes (fp16, headers excluded): (H + 2·H_kv)·d·2 per token per layer."""
    per_token = (geometry.num_heads + 2 * geometry.num_kv_heads) * geometry.head_dim * 2
    return per_token * num_seqs * seq_len * geometry.num_layers


@dataclass
class LayerActivations:
    """One layer's read-only fp16 memmaps: q (S, H, L, d), k and v (S, H_kv, L, d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray

    def torch(self, indices=slice(None), values: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """float32 (q, k, v) for the selected sequences; v is None (not read) unless ``values``."""
        read = lambda a: torch.from_numpy(np.asarray(a[indices], dtype=np.float32))  # noqa: E731
        return read(self.q), read(self.k), read(self.v) if values else None


class ActivationCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.key = self.path.name
        self.meta = json.loads((self.path / "meta.json").read_text())

    def layer(self, i: int) -> LayerActivations:
        return LayerActivations(*(np.load(self.path / f"layer_{i:02d}_{kind}.npy", mmap_mode="r")
                                  for kind in KINDS))

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob("*.npy"))


def verify_cache(path: Path, fields: dict | None = None) -> str | None:
    """None when the cache at ``path`` is complete and intact, else what is wrong (one phrase)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return "its manifest or meta file is missing or unreadable"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"it was written by format version {meta.get('format_version')}, not {FORMAT_VERSION}"
    if fields is not None and meta.get("fields") != json.loads(json.dumps(fields, default=str)):
        return "it was written for another model, data or settings (foreign meta)"
    for name, entry in manifest.items():
        file = path / name
        if not file.exists() or file.stat().st_size != entry["size"]:
            return f"{name} is missing or truncated"
        if file_sha256(file) != entry["sha256"]:
            return f"{name} is corrupted (checksum mismatch)"
    return None


def build_or_load_cache(model, tokens: torch.Tensor, fields: dict, root: Path, batch_size: int = 4,
                        progress: bool = True) -> ActivationCache:
    """The cache for ``tokens`` (S, L) under ``root``: reused if intact, else built exactly once."""
    root = Path(root)
    key = cache_key(fields)
    final = root / key
    if distributed.world() > 1:
        return _build_or_load_distributed(model, tokens, fields, final, batch_size, progress)
    if final.exists() and _usable(final, fields):
        logger.info(f"dofla: reusing activation cache {final}")
        return ActivationCache(final)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if final.exists() and _usable(final, fields):  # another job built it while we waited
            logger.info(f"dofla: reusing activation cache {final} (built by another job)")
            return ActivationCache(final)
        _build(model, tokens, fields, final, batch_size, progress)
    return ActivationCache(final)


def _usable(path: Path, fields: dict) -> bool:
    problem = verify_cache(path, fields)
    if problem is None:
        return True
    logger.warning(f"dofla: activation cache {path} is not usable ({problem}); rebuilding it")
    return False


def _build_or_load_distributed(model, tokens, fields: dict, final: Path, batch_size: int,
                               progress: bool) -> ActivationCache:
    """Under torchrun: rank 0 checks / locks / creates the files, each rank fills its batches,
    rank 0 seals the manifest. Same batches as one process, so the same bytes."""
    lock = FileLock(str(final.parent / f"{final.name}.lock"))
    ready, problem = None, None
    if distributed.is_main():
        final.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        ready = final.exists() and _usable(final, fields)
    try:
        if distributed.broadcast(ready):
            if distributed.is_main():
                logger.info(f"dofla: reusing activation cache {final}")
            return ActivationCache(final)
        adapter = get_adapter(model)
        geometry = adapter.geometry(model.config)
        tmp = final.parent / f"{final.name}.tmp-dist"
        if distributed.is_main():
            try:
                _prepare(final, tmp, geometry, *tokens.shape)
                _flush(_open_arrays(tmp, geometry, *tokens.shape))  # create the files for every rank
            except BaseException as err:
                problem = str(err)
                distributed.broadcast(problem)
                raise
        problem = distributed.broadcast(problem)
        if problem is not None:
            raise CacheError(problem)
        arrays = _open_arrays(tmp, geometry, *tokens.shape, mode="r+")
        starts = distributed.mine(range(0, tokens.shape[0], batch_size))
        _fill(model, adapter, tokens, arrays, batch_size, progress and distributed.is_main(), starts)
        _flush(arrays)
        distributed.barrier()
        if distributed.is_main():
            _seal(tmp, final, fields, geometry, *tokens.shape)
        distributed.barrier()
    finally:
        if distributed.is_main():
            lock.release()
    return ActivationCache(final)


def _build(model, tokens: torch.Tensor, fields: dict, final: Path, batch_size: int, progress: bool) -> None:
    adapter = get_adapter(model)
    geometry = adapter.geometry(model.config)
    num_seqs, seq_len = tokens.shape
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    _prepare(final, tmp, geometry, num_seqs, seq_len)
    arrays = _open_arrays(tmp, geometry, num_seqs, seq_len)
    _fill(model, adapter, tokens, arrays, batch_size, progress, range(0, num_seqs, batch_size))
    _flush(arrays)
    _seal(tmp, final, fields, geometry, num_seqs, seq_len)


def _flush(arrays: list[dict]) -> None:
    for layer in arrays:
        for array in layer.values():
            array.flush()
    arrays.clear()


def _prepare(final: Path, tmp: Path, geometry: AttentionGeometry, num_seqs: int, seq_len: int) -> None:
    """Check the disk, clear killed builds and an unusable old cache, create the temp dir."""
    predicted = predict_cache_bytes(geometry, num_seqs, seq_len)
    free = shutil.disk_usage(final.parent).free
    logger.info(f"dofla: building activation cache {final} ({predicted / 2**20:.1f} MiB, "
          f"{free / 2**30:.1f} GiB free)")
    if free < predicted * 1.05 + 2**26:
        raise CacheError(f"the activation cache needs {predicted / 2**30:.2f} GiB but only {free / 2**30:.2f} "
                         f"GiB are free under {final.parent}; free disk or set cache_dir elsewhere")
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a build that was killed
    if final.exists():
        shutil.rmtree(final)
    tmp.mkdir()


def _seal(tmp: Path, final: Path, fields: dict, geometry: AttentionGeometry, num_seqs: int, seq_len: int) -> None:
    """meta.json and the checksum manifest, then the atomic rename into place."""
    predicted = predict_cache_bytes(geometry, num_seqs, seq_len)
    meta = {"fields": json.loads(json.dumps(fields, default=str)), "format_version": FORMAT_VERSION,
            "num_layers": geometry.num_layers, "num_seqs": num_seqs, "seq_len": seq_len,
            "num_heads": geometry.num_heads, "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim, "dtype": "float16", "data_bytes": predicted}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    manifest = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.glob("*.npy"))}
    manifest["meta.json"] = {"size": (tmp / "meta.json").stat().st_size, "sha256": file_sha256(tmp / "meta.json")}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, final)


def _open_arrays(tmp: Path, g: AttentionGeometry, num_seqs: int, seq_len: int, mode: str = "w+") -> list[dict]:
    shapes = {"q": (num_seqs, g.num_heads, seq_len, g.head_dim),
              "k": (num_seqs, g.num_kv_heads, seq_len, g.head_dim),
              "v": (num_seqs, g.num_kv_heads, seq_len, g.head_dim)}
    if mode == "r+":  # files made by another rank: open, do not create
        return [{kind: np.lib.format.open_memmap(tmp / f"layer_{i:02d}_{kind}.npy", mode="r+") for kind in KINDS}
                for i in range(g.num_layers)]
    return [{kind: np.lib.format.open_memmap(tmp / f"layer_{i:02d}_{kind}.npy", mode=mode,
                                             dtype=np.float16, shape=shapes[kind]) for kind in KINDS}
            for i in range(g.num_layers)]


@torch.no_grad()
def _fill(model, adapter, tokens: torch.Tensor, arrays: list[dict], batch_size: int, progress: bool,
          starts) -> None:
    """Teacher forward over the batches beginning at ``starts``; q, k, v rows into ``arrays``."""
    rows = slice(0, 0)

    def write(layer: int, q, k, v) -> None:
        for kind, value in zip(KINDS, (q, k, v)):
            arrays[layer][kind][rows] = value.to(torch.float16).cpu().numpy()

    device = next(model.parameters()).device
    with capturing(model, adapter.attention_modules(model), write):
        for start in tqdm(starts, desc="cache (teacher pass)", unit="batch", disable=not progress):
            kill_point(f"cache:batch{start // batch_size}")
            rows = slice(start, start + batch_size)
            model(input_ids=tokens[rows].to(device), use_cache=False)


def pooled_activations(cache, layer: int, num_tokens: int | None):
    """Queries (N, H, d) and keys (N, H_kv, d) of one layer of ``cache``, as float32 tensors: the
    first ``num_tokens`` tokens (whole sequences; None: all), the pool Algorithm 1 samples from."""
    acts = cache.layer(layer)
    seqs = acts.q.shape[0]
    if num_tokens is not None:
        seqs = max(1, min(seqs, -(-num_tokens // acts.q.shape[2])))
    q = torch.from_numpy(acts.q[:seqs].astype("float32"))  # (S, H, L, d)
    k = torch.from_numpy(acts.k[:seqs].astype("float32"))  # (S, H_kv, L, d)
    return q.transpose(1, 2).flatten(0, 1), k.transpose(1, 2).flatten(0, 1)
