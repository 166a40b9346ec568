"""Put a committed allocation's measured menu back into the allocator's cache:
``python -m studies.budget_menu docs/results/runs/budget/share0.1_s0/allocation.json``.

Measuring the menu is most of an allocation's cost (about 43 min for SmolLM2's 90 KV heads on 2 CPU cores);
every budget and weighting of one data order solves on the same measurement. A record keeps that
measurement (each option's signals at every KV head, and the settings it was measured under), so a fresh
machine can solve a new budget or weighting on it and measure only its chosen plan: this writes the menu
where ``allocation=budget`` looks for it (``dofla.dof.restore_menu``), under the cache directory
a run with default paths uses (DOFLA_CACHE_DIR, else the user cache), or ``--cache-dir``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dofla.dof import restore_menu
from dofla.models import cache_root as default_root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.budget_menu", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="allocation.json files of measured allocations")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the runs' paths.cache_dir (default: DOFLA_CACHE_DIR or the user cache, /activations)")
    args = parser.parse_args(argv)
    root = args.cache_dir if args.cache_dir is not None else default_root() / "activations"
    for path in args.records:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"budget_menu: {path} is not a readable allocation.json ({error}); give a record's "
                             "file") from None
        print(f"budget_menu: {path} -> {restore_menu(record, root)}")


if __name__ == "__main__":
    main()
