"""Where a measured menu is kept between runs, and how a committed record's measurement is put back there.

Measuring the menu is most of an allocation's cost; every budget and weighting of one teacher, menu and
calibration solves on the same measurement. :func:`menu_file` names its file under the cache root, keyed on
an allocation's settings less what only the solve reads (``SOLVE_ONLY``) and the repair rounds;
:func:`restore_menu` writes a recorded allocation's measurement there, so a fresh machine solves on the
committed measurement instead of measuring again (``studies/budget_menu.py``). A menu that extends one measured
before (the same settings, other options: another window, another M) measures its new options alone and takes
the rest from that file (:func:`earlier_menu`, :func:`dofla.dof.sensitivity.measure_menu`'s ``known``).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from dofla.dof.allocator import menu_signals
from dofla.dof.menu import default_menu, label
from dofla.record import read_json, write_json

# the budget's fields that choose among the measured options, not what is measured: another budget or other
# weights solve again on the same measured menu
SOLVE_ONLY = ("mib", "share", "kl_weight", "retrieval_weight", "copy_weight", "solver", "state_sizing")
# the budget's fields that say which options the menu offers
MENU_FIELDS = ("exact", "windows", "sinks", "states", "pure_states")


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


def menu_labels(key: dict) -> list[str] | None:
    """The option labels of the menu a menu file's ``key`` measured (None where the key does not say)."""
    budget = key.get("budget", {})
    if any(f not in budget for f in MENU_FIELDS):
        return None
    return [label(o) for o in default_menu(SimpleNamespace(**{f: budget[f] for f in MENU_FIELDS}))]


def earlier_menu(root: Path, key: dict) -> dict | None:
    """The menu measured before under the cache ``root`` on the settings of ``key`` (a :func:`menu_file` key)
    but for the menu's options, that shares the most options with this menu: {"file", "menu": its labels,
    "shared": the labels both hold, "seconds": what measuring it took, "base", "signals"}; None where no file
    shares an option (:func:`dofla.dof.sensitivity.measure_menu` then checks its baseline again)."""
    def rest(k: dict) -> dict:
        return {**k, "budget": {f: v for f, v in k["budget"].items() if f not in MENU_FIELDS}}

    mine = menu_labels(key)
    best = None
    for path in sorted((root / "allocations").glob("menu-*.json")):
        kept = read_json(path)
        settings = kept.get("settings") if isinstance(kept, dict) else None
        if not isinstance(settings, dict) or "budget" not in settings or settings == key \
                or rest(settings) != rest(key) or (labels := menu_labels(settings)) is None:
            continue
        shared = [name for name in mine if name in labels]
        if shared and (best is None or len(shared) > len(best["shared"])):
            best = {"file": path.name, "menu": labels, "shared": shared, "seconds": kept["seconds"],
                    **kept["measured"]}
    return best
