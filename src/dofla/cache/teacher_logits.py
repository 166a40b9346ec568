"""The teacher's next-token targets over a KL text, computed once and shared (``distill.teacher_cache``).

The distill stage's teacher gives the same targets every time it reads the same text, and the
results pages read one KL text (``distill.offset``) in many runs. Each row of token ids is stored
once, as ``<root>/<namespace>/<digest>.safetensors``:

- the namespace (:func:`namespace_key`) hashes what the caller says identifies the teacher (model,
  revision, dtype, precision), the format (exact, or the top k) and, for top-k, the temperature;
- the digest hashes the row's token ids: the teacher's whole input, since a row's logits depend on
  nothing else. Its offset in the text and its length are in the ids; so are far copies
  (``distill.copy_share`` rewrites the ids the teacher reads). Window dropout changes the student
  only, and is not in the key.

An entry is written under a temporary name and renamed into place. Its header names the namespace's
fields, the digest and a CRC-32 of each tensor, so a truncated, corrupted or foreign entry is refused
in one sentence and recomputed. Rows are computed under a file lock (one of 256 stripes, by digest),
so two jobs reading the same text compute it once: the second waits, then reads. The whole root is
bounded (``limit_bytes``): after each write the least recently used entries (a read refreshes an
entry's time) are deleted until it fits.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dofla.train.kl_targets import ExactTargets, TopKTargets

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
STALE_SECONDS = 3600  # a temporary file this old belongs to a killed writer
Targets = ExactTargets | TopKTargets


def namespace_key(fields: dict) -> str:
    payload = json.dumps({**fields, "format_version": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def row_digest(row: torch.Tensor) -> str:
    """The key of one row of token ids (L,): its length and its ids."""
    ids = row.detach().to("cpu", torch.int64).contiguous()
    return hashlib.sha256(f"{ids.numel()}:".encode() + ids.numpy().tobytes()).hexdigest()[:32]


def entry_bytes(seq_len: int, vocab: int, topk: int, logit_bytes: int = 4) -> int:
    """The data bytes of one row's entry: exact logits (L·V at ``logit_bytes``), or top-k (float32
    log-probabilities and int32 ids, L·k each, and L float32 rest masses)."""
    return seq_len * vocab * logit_bytes if topk == 0 else seq_len * (8 * topk + 4)


def _tensors(targets: Targets, i: int) -> dict[str, torch.Tensor]:
    """Row ``i`` of ``targets`` as named CPU tensors."""
    if isinstance(targets, ExactTargets):
        named = {"logits": targets.logits[i]}
    else:
        named = {"log_probs": targets.log_probs[i], "ids": targets.ids[i], "log_rest": targets.log_rest[i]}
    return {k: v.detach().to("cpu").contiguous() for k, v in named.items()}


def _stacked(rows: list[dict[str, torch.Tensor]], device) -> Targets:
    joined = {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}
    return ExactTargets(**joined) if "logits" in joined else TopKTargets(**joined)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data)


class TeacherLogitCache:
    """The stored targets of one teacher in one format (``fields``) under ``root``, bounded to
    ``limit_bytes`` for the whole root."""

    def __init__(self, root: Path, fields: dict, limit_bytes: int):
        self.root, self.limit = Path(root), int(limit_bytes)
        self.fields = json.loads(json.dumps(fields, sort_keys=True, default=str))
        self.dir = self.root / namespace_key(fields)
        self.hits = self.misses = 0
        self._warned_disk = False

    def targets(self, ids: torch.Tensor, compute: Callable[[torch.Tensor], Targets]) -> Targets:
        """The targets of ``ids`` (B, L): each row's stored entry, or ``compute(rows)`` for the rows
        without one (then stored)."""
        digests = [row_digest(row) for row in ids]
        self.dir.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            for stripe in sorted({d[:2] for d in digests}):  # one order for every job: no deadlock
                stack.enter_context(FileLock(str(self.dir / f"{stripe}.lock")))
            rows = [self._load(d, ids.shape[1]) for d in digests]
            missing = [i for i, row in enumerate(rows) if row is None]
            self.hits, self.misses = self.hits + len(rows) - len(missing), self.misses + len(missing)
            computed = compute(ids[missing]) if missing else None
            for j, i in enumerate(missing):
                rows[i] = _tensors(computed, j)
                self._store(digests[i], rows[i])
        if missing:
            self._evict({self.dir / f"{d}{SUFFIX}" for d in digests})
        if len(missing) == len(rows):
            return computed  # what the teacher gave, where it gave it (the stored bits)
        return _stacked(rows, ids.device)

    def _load(self, digest: str, seq_len: int) -> dict[str, torch.Tensor] | None:
        path = self.dir / f"{digest}{SUFFIX}"
        if not path.exists():
            return None
        problem, tensors = self._check(path, digest, seq_len)
        if problem is not None:
            logger.warning(f"dofla: teacher-logit cache entry {path} is not usable ({problem}); recomputing it")
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used
        return tensors

    def _check(self, path: Path, digest: str, seq_len: int) -> tuple[str | None, dict]:
        try:
            with safe_open(path, framework="pt") as handle:
                meta = handle.metadata() or {}
                tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        except (OSError, ValueError, SafetensorError) as err:
            return f"unreadable or truncated: {type(err).__name__}", {}
        if json.loads(meta.get("fields", "null")) != self.fields or meta.get("digest") != digest:
            return "it was written for another teacher, format or text", {}
        if any(t.shape[0] != seq_len for t in tensors.values()):
            return f"it holds {next(iter(tensors.values())).shape[0]} positions, not {seq_len}", {}
        crcs = json.loads(meta.get("crc32", "{}"))
        if crcs.keys() != tensors.keys() or any(_crc(t) != crcs[k] for k, t in tensors.items()):
            return "corrupted: checksum mismatch", {}
        return None, tensors

    def _store(self, digest: str, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.limit or shutil.disk_usage(self.dir).free < size + 2**26:
            if not self._warned_disk:
                logger.warning(f"dofla: teacher-logit cache: no room for a {size / 2**20:.0f} MiB entry under {self.dir} "
                      "(its limit or the free disk); rows are computed without being stored")
                self._warned_disk = True
            return
        meta = {"fields": json.dumps(self.fields, sort_keys=True), "digest": digest,
                "crc32": json.dumps({k: _crc(t) for k, t in tensors.items()})}
        final = self.dir / f"{digest}{SUFFIX}"
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def _evict(self, keep: set[Path]) -> None:
        """Delete the least recently used entries (of every namespace) until the root fits its limit."""
        entries, now = [], time.time()
        for path in self.root.glob(f"*/*{SUFFIX}*"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another job evicted it meanwhile
                continue
            if path.suffix != SUFFIX:  # a killed writer's temporary file
                if now - stat.st_mtime > STALE_SECONDS:
                    path.unlink(missing_ok=True)
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit:
                break
            if path not in keep:
                path.unlink(missing_ok=True)
                total -= size

    def nbytes(self) -> int:
        """Bytes held by this namespace's entries."""
        return sum(p.stat().st_size for p in self.dir.glob(f"*{SUFFIX}"))
