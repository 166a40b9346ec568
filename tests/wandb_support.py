"""What the wandb tests share: a server that cannot be reached, and the records of a run's binary
log (``run-<id>.wandb``), read with wandb's own protobuf messages, so that tests check what a run
holds (its id, metric definitions, summary) rather than bytes that merely occur in the file.

The file is wandb's framing of LevelDB's log format: a 7-byte header (``:W&B``, a magic number, a
version), then 32 KiB blocks of chunks, each a 7-byte header (CRC, length, kind) and its data;
a record is one FULL chunk or a FIRST, MIDDLE..., LAST run of them.
"""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every complete record in the file, in order (a file cut short by a kill ends early)."""
    from wandb.proto import wandb_internal_pb2 as pb  # lazy: wandb is an optional extra

    data, pos, parts, out = Path(path).read_bytes(), HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def of_kind(path: Path, kind: str) -> list:
    """The records' ``kind`` messages (``run``, ``metric``, ``summary``, ``history``, ...)."""
    return [getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind]


def summary(path: Path) -> dict:
    """The run's summary at its last update: key -> the JSON text wandb stores."""
    out = {}
    for update in of_kind(path, "summary"):
        for item in update.update:
            out["/".join(item.nested_key) or item.key] = item.value_json
    return out


def history_values(path: Path, key: str) -> list[str]:
    """Every value ``key`` was logged with, in order (JSON text)."""
    return [item.value_json for row in of_kind(path, "history") for item in row.item
            if "/".join(item.nested_key) == key or item.key == key]


def binary_log(wandb_run_dir: Path) -> Path:
    """The binary log in one wandb run's directory (``wandb/offline-run-<time>-<id>``)."""
    (path,) = Path(wandb_run_dir).glob("*.wandb")
    return path


def closed_port() -> int:
    """A local port nothing listens on (bound by the system, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable_server(port: int) -> dict:
    """Online mode with a key, against the server at ``port`` on this machine; wandb.init gives up
    after WANDB_INIT_TIMEOUT seconds (wandb's own setting)."""
    return {"WANDB_MODE": "online", "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "x" * 40,
            "WANDB_INIT_TIMEOUT": "3"}


class _Unavailable(BaseHTTPRequestHandler):
    def do_GET(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@contextmanager
def unavailable_server():
    """A local HTTP server that answers every request with 503: reachable, but never a wandb server
    (wandb.init retries it until its timeout). Yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
