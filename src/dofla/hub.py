"""Is the Hugging Face hub reachable? Checked in seconds, so offline runs fail fast and clearly."""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from urllib.parse import urlparse


def hub_offline() -> bool:
    """The user asked for offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(name, "0").lower() not in ("0", "", "false")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub endpoint accepts a TCP connection within ``timeout`` seconds."""
    if hub_offline():
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextmanager
def forced_offline():
    """Make ``huggingface_hub`` / ``datasets`` / ``transformers`` use only the local cache."""
    from huggingface_hub import constants

    modules = [constants]
    try:
        import datasets

        modules.append(datasets.config)
    except ImportError:
        pass
    saved = [m.HF_HUB_OFFLINE for m in modules]
    for m in modules:
        m.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for m, value in zip(modules, saved):
            m.HF_HUB_OFFLINE = value
