"""Experiment trackers: ``none`` (files only) and ``wandb`` (never blocks without network)."""
from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dofla.config import LoggerConfig
from dofla.report.seeds import settings_hash

logger = logging.getLogger(__name__)


def split_overrides(name: str) -> list[str]:
    """``a=1,b=[x,y],c=2`` -> ``["a=1", "b=[x,y]", "c=2"]``: commas inside brackets are values."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(name):
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            items.append(name[start:i])
            start = i + 1
    items.append(name[start:])
    return [item for item in items if item]


def seed_group(config: dict, name: str) -> str:
    """The wandb group of a run: its overrides without seed and paths, then a hash of its settings
    without seed (``dofla.report.seeds.settings_hash``), so runs that differ only in their seed
    share one group and nothing else does. At most 128 characters (wandb's limit)."""
    kept = [o for o in split_overrides(name) if o.partition("=")[0].lstrip("+~") != "seed"
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
    """Weights & Biases: online when logged in (WANDB_API_KEY or `wandb login`), else offline, said on one line."""

    def __init__(self, cfg: LoggerConfig, config: dict, out_dir: Path, name: str, tags: list[str] = ()):
        import wandb  # lazy: wandb is an optional extra

        mode = wandb_mode(cfg)
        if mode == "offline":
            logger.info(f"dofla: wandb logs offline into {out_dir}/wandb ({offline_reason(cfg)}); upload later with "
                  f"`wandb sync {out_dir}/wandb/offline-run-*`")
        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project, group=cfg.group or seed_group(config, name), config=config, dir=str(out_dir),
            name=name, job_type=config.get("allocation", {}).get("policy"), tags=list(tags) or None, mode=mode,
            reinit="finish_previous",
            settings=wandb.Settings(init_timeout=60, silent=True),
        )

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path) -> None:
        self.run.log({key: self._wandb.Image(str(path))})

    def log_table(self, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self._wandb.Table(columns=columns, data=rows)})

    def finish(self) -> None:
        self.run.finish()


def wandb_logged_in() -> bool:
    """A W&B key is available: WANDB_API_KEY, or the netrc entry `wandb login` writes for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
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


def build_tracker(cfg: LoggerConfig, config: dict, out_dir: Path, name: str, tags: list[str] = ()) -> NullTracker:
    if cfg.name == "wandb":
        return WandbTracker(cfg, config, out_dir, name, tags)
    return NullTracker()
