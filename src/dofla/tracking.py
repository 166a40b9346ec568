"""Experiment trackers: ``none`` (files only) and ``wandb`` (one wandb run per run directory; without
network it logs offline, and a server that cannot be reached does not stop the run)."""
from __future__ import annotations

import logging
import netrc
import os
import ssl
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dofla.config import LoggerConfig
from dofla.record import read_json, write_json
from dofla.report.seeds import settings_hash

logger = logging.getLogger(__name__)


def seed_group(config: dict, overrides: list[str]) -> str:
    """The wandb group of a run: its overrides (Hydra's own list, one item per override, so a value
    holding commas stays whole) without seed and paths, then a hash of its settings without seed
    (``dofla.report.seeds.settings_hash``), so runs that differ only in their seed share one group
    and nothing else does. At most 128 characters (wandb's limit)."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") != "seed"
            and "dir" not in o.partition("=")[0]]
    return f"{','.join(kept)[:110] or 'default'}-{settings_hash(config)}"


class NullTracker:
    """Keeps nothing beyond the run's own files."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        pass

    def log_image(self, key: str, path: Path) -> None:
        pass

    def log_table(self, key: str, columns: list[str], rows: list[list]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(NullTracker):
    """Weights & Biases: online when logged in (WANDB_API_KEY or `wandb login`), else offline, said on one line.

    One wandb run per run directory: its id is kept in the directory (:func:`run_id`) and opened with
    ``resume="allow"``, so a resumed or requeued run continues the same wandb run. A server that cannot
    be reached at start (a node without internet) turns the run offline instead of stopping it."""

    def __init__(self, cfg: LoggerConfig, config: dict, out_dir: Path, name: str, tags: list[str] = (),
                 overrides: list[str] = ()):
        import wandb  # lazy: wandb is an optional extra

        self._wandb, self.stages, self.defined = wandb, set(), set()
        mode, out_dir = wandb_mode(cfg), Path(out_dir)
        sync = f"upload later with `wandb sync {out_dir}/wandb/offline-run-*`"
        if mode == "offline":
            logger.info(f"dofla: wandb logs offline into {out_dir}/wandb ({offline_reason(cfg)}); {sync}")
        init = dict(project=cfg.project, group=cfg.group or seed_group(config, list(overrides)), config=config,
                    dir=str(out_dir), name=name, job_type=config.get("allocation", {}).get("policy"),
                    tags=list(tags) or None, resume="allow",
                    id=None if mode == "disabled" else run_id(out_dir), reinit="finish_previous",
                    settings=wandb.Settings(silent=True, **init_timeout()))
        unreachable = None if mode in ("offline", "disabled") else server_unreachable()
        if unreachable:  # checked first: a start that never reaches wandb.init leaves its service idle
            logger.warning(falling_back(out_dir, unreachable, sync))
            mode = "offline"
        try:
            self.run = wandb.init(mode=mode, **init)
        except (wandb.errors.CommError, TimeoutError, ConnectionError) as err:  # AuthenticationError is a CommError
            if mode in ("offline", "disabled"):
                raise
            logger.warning(falling_back(out_dir, f"{type(err).__name__}: {first_line(err)}", sync))
            # the failed attempt's service still holds the run id: a fresh one starts offline (wandb
            # 0.19.10's service keeps retrying the server instead of stopping: then no wandb at all)
            if not returns_within(wandb.teardown, TEARDOWN_SECONDS):
                raise WandbUnavailable(f"wandb's service did not stop within {TEARDOWN_SECONDS} s") from err
            self.run = wandb.init(mode="offline", **init)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._define(metrics)
        self.run.log(metrics, step=step)

    def _define(self, metrics: dict[str, Any]) -> None:
        """A live log (``dofla.train.live``: ``<stage>/step`` and ``<stage>/tokens`` together) makes that
        stage's token counter the x axis of its curves, so the layerwise and KL curves do not share
        wandb's global step (which a resumed run also moves); each held-out loss keeps its minimum as
        its summary, the value of the state the trainer keeps."""
        live = {key.partition("/")[0] for key in metrics if key.endswith("/tokens")}
        for stage in sorted(stage for stage in live if f"{stage}/step" in metrics):
            counter = f"{stage}/tokens"
            if stage not in self.stages:
                self.stages.add(stage)
                self.run.define_metric(counter)
                self.run.define_metric(f"{stage}/*", step_metric=counter)
            for key in metrics:
                if key.startswith(f"{stage}/") and key.endswith("heldout_loss") and key not in self.defined:
                    self.defined.add(key)
                    self.run.define_metric(key, step_metric=counter, summary="min")

    def log_image(self, key: str, path: Path) -> None:
        self.run.log({key: self._wandb.Image(str(path))})

    def log_table(self, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self._wandb.Table(columns=columns, data=rows)})

    def finish(self) -> None:
        self.run.finish()


TEARDOWN_SECONDS = 30


class WandbUnavailable(Exception):
    """wandb can neither reach its server nor restart offline in this process."""


def returns_within(fn, seconds: float) -> bool:
    """Whether ``fn()`` returned within ``seconds`` (run in a daemon thread, left behind if not)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def run_id(out_dir: Path) -> str:
    """The wandb run id of a run directory: made at its first start and kept in ``wandb/run_id.json``
    inside it, so every resume or requeue of the directory opens the same wandb run, and a new run
    in a reused path (its old files deleted) a new one. Written before ``wandb.init``: a run killed
    during its start still finds it."""
    path = Path(out_dir) / "wandb" / "run_id.json"
    stored = read_json(path)
    if isinstance(stored, dict) and isinstance(stored.get("id"), str):
        return stored["id"]
    made = uuid.uuid4().hex[:16]
    write_json(path, {"id": made})
    return made


def init_timeout() -> dict:
    """60 s for wandb.init to reach its server, unless WANDB_INIT_TIMEOUT says otherwise (a setting
    given to wandb.init would override the variable)."""
    return {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": 60}


def server_unreachable(seconds: float = 10.0) -> str | None:
    """Why wandb's server cannot be reached (a refused or timed-out connection, an unknown host), or
    None when it answers at all: one HTTP request through the environment's proxies, before
    ``wandb.init``, so a node without network goes offline at once."""
    try:
        urllib.request.urlopen(wandb_host(), timeout=seconds).close()
    except urllib.error.HTTPError:
        return None  # an answer, whatever its status: the rest is wandb.init's to judge
    except urllib.error.URLError as err:
        return None if isinstance(err.reason, ssl.SSLError) else f"{type(err.reason).__name__}: {err.reason}"
    except (OSError, ValueError) as err:  # a timeout while reading, a malformed WANDB_BASE_URL
        return f"{type(err).__name__}: {first_line(err)}"
    return None


def falling_back(out_dir: Path, reason: str, sync: str) -> str:
    return (f"dofla: wandb cannot log to {wandb_host()} ({reason}); the run goes on offline into "
            f"{out_dir}/wandb; {sync}")


def first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def wandb_host() -> str:
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def wandb_logged_in() -> bool:
    """A W&B key is available: WANDB_API_KEY, or the netrc entry `wandb login` writes for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(wandb_host()).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: LoggerConfig) -> str:
    """``logger.mode``, else WANDB_MODE, else online when logged in (a key or `wandb login`), else offline."""
    return cfg.mode or os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")


def offline_reason(cfg: LoggerConfig) -> str:
    if cfg.mode or os.environ.get("WANDB_MODE"):
        return "logger.mode" if cfg.mode else "WANDB_MODE"
    return "no WANDB_API_KEY and no `wandb login`"


def run_tags(config: dict, experiment: str | None = None, sweep_dir: str | None = None) -> list[str]:
    """Tags a run is found by in wandb: its experiment, its sweep (the sweep directory's last two
    parts, e.g. ``sweep:2026-11-25/14-02-11``), its policy, loss, feature map and attention."""
    tags = [f"experiment:{experiment}" if experiment else None,
            f"sweep:{'/'.join(Path(sweep_dir).parts[-2:])}" if sweep_dir else None]
    for tag, section, field in (("policy", "allocation", "policy"), ("loss", "loss", "name"),
                                ("features", "feature_map", "name"), ("attention", "attention", "name")):
        value = (config.get(section) or {}).get(field)
        tags.append(f"{tag}:{value}" if value else None)
    return [tag[:64] for tag in tags if tag]  # wandb's limit per tag


def build_tracker(cfg: LoggerConfig, config: dict, out_dir: Path, name: str, tags: list[str] = (),
                  overrides: list[str] = ()) -> NullTracker:
    """``overrides``: the run's command-line overrides as Hydra lists them (``hydra.overrides.task``)."""
    if cfg.name == "wandb":
        try:
            return WandbTracker(cfg, config, out_dir, name, tags, overrides)
        except WandbUnavailable as err:
            logger.warning(f"dofla: {err}; the run goes on without wandb (its results are in {out_dir})")
    return NullTracker()
