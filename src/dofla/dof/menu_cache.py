"""Where a measured menu is kept between runs, and how a committed record's measurement is put back there.

Measuring the menu is most of an allocation's cost; every budget and weighting of one teacher, menu and
calibration solves on the same measurement. :func:`menu_file` names its file under the cache root, keyed on
an allocation's settings less what only the solve reads (``SOLVE_ONLY``) and the repair rounds;
:func:`restore_menu` writes a recorded allocation's measurement there, so a fresh machine solves on the
committed measurement instead of measuring again (``studies/budget_menu.py``).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dofla.dof.allocator import menu_signals
from dofla.record import write_json

# the budget's fields that choose among the measured options, not what is measured: another budget or other
# weights solve again on the same measured menu
SOLVE_ONLY = ("mib", "share", "kl_weight", "retrieval_weight", "copy_weight", "solver", "state_sizing")


def menu_file(root: Path, settings: dict) -> tuple[Path, dict]:
    """Where the menu measured for an allocation of ``settings`` (an ``allocation.json``'s) is kept under the
    cache ``root``, and its key: the settings less the budget's size and weights (``SOLVE_ONLY``), the
    repair rounds, the DoF the states are sized by and the options' prices (the solve reads them, the measurement
    does not), so every budget and weighting of one teacher, menu and calibration shares it."""
    key = {**settings, "budget": {k: v for k, v in settings["budget"].items() if k not in SOLVE_ONLY}}
    key.pop("repair_rounds")
    key.pop("prices", None)
    key.pop("dof", None)  # the DoF that state_sizing=dof sizes the states by
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return root / "allocations" / f"menu-{digest}.json", key


def restore_menu(record: dict, root: Path) -> Path:
    """Put a recorded allocation's measured menu (its ``settings``, ``base_signals`` and ``signals``) where
    :func:`dofla.stages.allocate.run_budget` looks for it under the cache ``root``: a fresh machine then solves
    another budget or weighting of the same data order on it instead of measuring the menu again. Returns the
    file written."""
    measured = menu_signals(record)
    if measured is None or "settings" not in record:
        raise ValueError("this allocation record holds no measured menu (a random plan, or one written before "
                         "records kept their settings); measure the menu by running the allocation")
    path, key = menu_file(root, record["settings"])
    write_json(path, {"settings": key, "measured": measured, "seconds": record["menu_measurement"]["seconds"]})
    return path
