"""The ``dofla`` command: Hydra composes conf/, the typed config goes to ``pipeline.run``.

Hydra lives only here. ``dofla`` runs the whole pipeline on the embedded SmolLM2; ``dofla -m
allocation=fix,dof,dof_clip`` sweeps; ``dofla-report DIR`` compares runs.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dofla import distributed
from dofla.config import RunConfig
from dofla.errors import DoflaError
from dofla.evaluate_saved import evaluate_saved
from dofla.logs import setup_logging
from dofla.pipeline import run
from dofla.report.tables import write_report
from dofla.runtime import keep_freed_memory
from dofla.stages.data import prepare
from dofla.tracking import NullTracker, build_tracker, run_tags
from dofla.validate import validate_config


def find_conf_dir() -> Path:
    """The checkout's top-level conf/ when running from a source tree, else the wheel's dofla/conf."""
    package = Path(__file__).resolve().parent
    root = package.parents[1]
    checkout = root / "conf"
    in_checkout = package == root / "src" / "dofla" and (root / "pyproject.toml").is_file()
    if in_checkout and (checkout / "config.yaml").is_file():
        return checkout
    return package / "conf"


CONF_DIR = find_conf_dir()
logger = logging.getLogger(__name__)

ConfigStore.instance().store(name="base_config", node=RunConfig)


def to_run_config(dcfg: DictConfig) -> RunConfig:
    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, RunConfig)
    return cfg


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main_hydra(dcfg: DictConfig) -> None:
    keep_freed_memory()  # here, not only in main(): a launcher's job process starts at this function
    cfg = to_run_config(dcfg)
    hydra_cfg = HydraConfig.get()
    distributed.init()  # under torchrun: one process group; every rank uses rank 0's run directory
    out_dir = Path(distributed.broadcast(hydra_cfg.runtime.output_dir))
    setup_logging(out_dir if distributed.is_main() else None)  # rank 0 writes the run's log file
    overrides = list(hydra_cfg.overrides.task)
    try:
        tracker = NullTracker()
        if distributed.is_main():
            config = OmegaConf.to_container(dcfg, resolve=True)
            sweep = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else None
            tracker = build_tracker(cfg.logger, config, out_dir, name=",".join(overrides) or "default",
                                    tags=run_tags(config, hydra_cfg.runtime.choices.get("experiment"), sweep),
                                    overrides=overrides)
        try:
            run(cfg, out_dir, overrides, tracker)
        finally:
            tracker.finish()
    except DoflaError as err:
        logger.error(f"dofla: error: {err}")
        sys.exit(2)


def main() -> None:
    if not (CONF_DIR / "config.yaml").is_file():
        sys.exit(f"dofla: error: config directory {CONF_DIR} has no config.yaml; reinstall dofla "
                 "(`pip install .` from a checkout ships conf/ inside the package)")
    main_hydra()
    distributed.finish()


REPORT_TABLES = {  # dofla-report --table NAME: a table module with main(argv)
    "hybrid": "dofla.report.hybrid_table",  # trained hybrids over seeds against a training-free baseline
    "tokens": "dofla.report.tokens",  # quality against distillation tokens, over seeds, with plots
    "frontier": "dofla.report.frontier",  # held-out loss and passkey against decode memory, one point per student
}


def report_main(argv: list[str] | None = None) -> None:
    """``dofla-report DIR [DIR ...]``: compare every run found under the given directories;
    ``dofla-report --table NAME ...``: one of the study tables (``--table NAME --help``)."""
    argv = sys.argv[1:] if argv is None else argv
    keep_freed_memory()
    setup_logging()
    if argv[:1] == ["--frontier"]:  # the frontier is one of the tables; --frontier is its short form
        argv = ["--table", "frontier", *argv[1:]]
    if argv[:1] == ["--table"] or (argv and argv[0].startswith("--table=")):
        name = argv[1] if argv[0] == "--table" and len(argv) > 1 else argv[0].partition("=")[2]
        if name not in REPORT_TABLES:
            sys.exit(f"dofla-report: error: --table {name!r} is not a table; choose one of: {', '.join(REPORT_TABLES)}")
        rest = argv[2:] if argv[0] == "--table" else argv[1:]
        return importlib.import_module(REPORT_TABLES[name]).main(rest)
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: dofla-report [DIR ...] | dofla-report --table {" + ",".join(REPORT_TABLES) + "} ...\n"
              "Compare every run under the directories (default: multirun_sweeps/): a table, plots and\n"
              "report.md in each. --table NAME prints one study table (--table NAME --help).")
        return None
    paths = [Path(p) for p in argv] or [Path("multirun_sweeps")]
    for path in paths:
        if not path.exists():
            sys.exit(f"dofla-report: error: {path} does not exist")
        write_report(path)


class SweepReport(Callback):
    """Hydra callback: after a multirun, write the comparison report into the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        setup_logging()  # the launcher's process: its jobs may have run elsewhere
        try:
            write_report(sweep_dir)
        except FileNotFoundError as err:
            logger.error(f"dofla: no report: {err}")


def compose_config(overrides: list[str]) -> RunConfig:
    """The typed config ``dofla OVERRIDES`` would run, composed without starting a Hydra job."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides))


def prepare_main(argv: list[str] | None = None) -> None:
    """``dofla-prepare [overrides]``: tokenise the data ``dofla [overrides]`` reads, once (see
    dofla.data.prepared); every run, sweep cell, resume and rank with that data and model reads it."""
    parser = argparse.ArgumentParser(prog="dofla-prepare", description="Tokenise the data a run reads, once, "
                                     "into the dofla cache (e.g. dofla-prepare experiment=paper_gpt2).")
    parser.add_argument("overrides", nargs="*", help="the run's Hydra overrides (model=..., data=..., experiment=...)")
    args = parser.parse_args(argv)
    keep_freed_memory()
    setup_logging()
    try:
        cfg = compose_config(args.overrides)
        validate_config(cfg)
        directory, meta = prepare(cfg)
    except HydraException as err:
        sys.exit(f"dofla-prepare: error: {str(err).splitlines()[0]}")
    except DoflaError as err:
        sys.exit(f"dofla-prepare: error: {err}")
    size = sum(f.stat().st_size for f in directory.iterdir())
    for split in ("train", "heldout"):
        m = meta[split]
        print(f"dofla-prepare: {split}: {m['tokens']:,} tokens from {m['documents']:,} documents "
              f"({'the whole split' if m['complete'] else 'a prefix of the split'})")
    print(f"dofla-prepare: wrote {directory} ({size / 2**20:,.1f} MiB); runs of this config read it "
          "(data.prepared=auto)")


def eval_main(argv: list[str] | None = None) -> None:
    """``dofla-eval DIR [--out OUT] [overrides]``: evaluate a saved model (see dofla.evaluate_saved)."""
    parser = argparse.ArgumentParser(prog="dofla-eval", description="Evaluate a saved student or any Hugging "
                                     "Face model directory; overrides are the pipeline's (eval=..., data=...).")
    parser.add_argument("model_dir", help="a directory written by save_pretrained (with its tokenizer)")
    parser.add_argument("--out", help="where metrics.json goes (default: outputs/eval/<date>/<time>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. eval=recall eval.tasks=[piqa]")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out or datetime.now().strftime("outputs/eval/%Y-%m-%d/%H-%M-%S"))
    keep_freed_memory()
    setup_logging(out)  # the compose API sets up no job logging: the log file is dofla's own
    try:
        cfg = compose_config(args.overrides)
        metrics = evaluate_saved(args.model_dir, cfg, out)
    except HydraException as err:
        sys.exit(f"dofla-eval: error: {str(err).splitlines()[0]}")
    except DoflaError as err:
        sys.exit(f"dofla-eval: error: {err}")
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"dofla-eval: wrote {out / 'metrics.json'}")
