"""Is the Hugging Face hub reachable? Checked in seconds, so offline runs fail fast and clearly."""
from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse
from urllib.request import getproxies, proxy_bypass

from huggingface_hub import constants


def hub_offline() -> bool:
    """The user asked for offline mode, as the hub libraries read it: ``huggingface_hub``'s own flag
    (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, read when it was imported, or set since), or one of those
    variables or ``datasets``' HF_DATASETS_OFFLINE as the environment holds it now, each read with the
    hub's truth values (1/ON/YES/TRUE; so ``no``, ``off``, ``0`` and ``false`` mean online)."""
    if constants.HF_HUB_OFFLINE:
        return True
    return any(os.environ.get(name, "").upper() in constants.ENV_VARS_TRUE_VALUES
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub endpoint resolves and accepts a TCP connection, all within ``timeout`` seconds.

    ``socket``'s own timeout does not cover the DNS lookup, which can hang for minutes on a machine
    with a dead resolver, so the lookup runs in a daemon thread that is abandoned at the deadline.
    """
    if hub_offline():
        return False
    host, port = _first_hop(constants.ENDPOINT)
    deadline = time.monotonic() + timeout
    found: list = []
    lookup = threading.Thread(daemon=True, target=lambda: found.append(_resolve(host, port)))
    lookup.start()
    lookup.join(timeout)
    for family, kind, proto, _, address in (found[0] if found else []):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(address)
                return True
        except OSError:
            continue
    return False


def _first_hop(endpoint: str) -> tuple[str, int]:
    """(host, port) a request to ``endpoint`` connects to first: the HTTPS proxy when one is set
    (HTTPS_PROXY / https_proxy, not bypassed by NO_PROXY), else the endpoint itself."""
    url = urlparse(endpoint)
    proxy = getproxies().get(url.scheme or "https")
    if proxy and not proxy_bypass(url.hostname or ""):
        hop = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return hop.hostname, hop.port or (443 if hop.scheme == "https" else 80)
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def _resolve(host: str, port: int) -> list:
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []


@contextmanager
def forced_offline():
    """Make ``huggingface_hub`` / ``datasets`` / ``transformers`` use only the local cache."""
    modules = [constants]
    try:
        import datasets  # lazy: datasets (hub data only) takes seconds to import

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
