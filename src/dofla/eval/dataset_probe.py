"""Which Hugging Face Hub datasets can be had right now: run as a script in a child process.

``downstream`` runs this file (not the package: no torch import) under a wall-clock timeout, so
a dead network or a stuck DNS lookup can never hang an evaluation. Reads a JSON list of
``{"path", "name"}`` on stdin and writes ``{"hub_reachable": bool, "available": [bool, ...]}``.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint, not a download: cheap and bounded by ``timeout_s``."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def cached(path: str, name: str | None) -> bool:
    """Whether ``datasets`` can load this dataset from the local cache alone (offline mode)."""
    import datasets  # lazy: datasets (hub data only) takes seconds to import
    # No trace in either cache means no load attempt (~0.3 s each; MMLU alone has 57 configs).
    traces = [Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___"),
              Path(constants.HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}"]
    if not any(t.exists() for t in traces):
        return False
    try:
        datasets.load_dataset(path, name)
        return True
    except Exception:  # any failure means "cannot be had offline"; the caller says so in one sentence
        return False


def main() -> None:
    specs = json.load(sys.stdin)
    reachable = hub_reachable()
    if not reachable:
        # Offline semantics must be set before datasets/huggingface_hub import, or they retry for ~25 s.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    available = [reachable or cached(s["path"], s.get("name")) for s in specs]
    json.dump({"hub_reachable": reachable, "available": available}, sys.stdout)


if __name__ == "__main__":
    main()
