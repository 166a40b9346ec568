"""Experiment trackers: ``none`` (files only) and ``wandb`` (never blocks without network)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dofla.config import LoggerConfig


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
    """Weights & Biases; with no key or network use WANDB_MODE=offline (sync later)."""

    def __init__(self, cfg: LoggerConfig, config: dict, out_dir: Path, name: str):
        import wandb

        mode = cfg.mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project, group=cfg.group, config=config, dir=str(out_dir), name=name,
            mode=mode, reinit="finish_previous", settings=wandb.Settings(init_timeout=60, silent=True),
        )

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path) -> None:
        self.run.log({key: self._wandb.Image(str(path))})

    def log_table(self, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self._wandb.Table(columns=columns, data=rows)})

    def finish(self) -> None:
        self.run.finish()


def build_tracker(cfg: LoggerConfig, config: dict, out_dir: Path, name: str) -> NullTracker:
    if cfg.name == "wandb":
        return WandbTracker(cfg, config, out_dir, name)
    return NullTracker()
