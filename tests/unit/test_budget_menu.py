"""Putting a recorded allocation's measured menu back into the cache (studies/budget_menu.py): one file per
teacher, menu and calibration, whatever the budget's size and weights; a record without a measured menu is
one sentence."""
from __future__ import annotations

import json

import pytest

from dofla.dof.menu_cache import SOLVE_ONLY, menu_file, restore_menu
from studies import budget_menu


def record(**budget) -> dict:
    settings = {"teacher": {"model": "t"}, "calibration": "sha256:0", "repair_rounds": 1,
                "budget": {"share": 0.1, "kl_weight": 1.0, "retrieval_weight": 1.0, "windows": [64], **budget}}
    return {"settings": settings, "base_signals": {"kl": 0.5, "nll": 9.0},
            "signals": [[{"kl": 0.5, "nll": 9.0}, {"kl": 0.4, "nll": 7.0}]], "menu_measurement": {"seconds": 12.5}}


def test_every_budget_and_weighting_of_one_menu_restores_to_one_file(tmp_path):
    path = restore_menu(record(), tmp_path)
    kept = json.loads(path.read_text())
    assert kept["measured"] == {"base": {"kl": 0.5, "nll": 9.0}, "signals": record()["signals"]}
    assert kept["seconds"] == 12.5 and "repair_rounds" not in kept["settings"]
    assert not set(SOLVE_ONLY) & set(kept["settings"]["budget"]) and kept["settings"]["budget"]["windows"] == [64]
    assert restore_menu(record(share=0.25, copy_weight=1.0, kl_weight=100.0), tmp_path) == path
    assert menu_file(tmp_path, record(windows=[256])["settings"])[0] != path  # another menu: another file


def test_the_options_prices_key_the_solve_not_the_measured_menu(tmp_path):
    """A record from before the prices were in the settings, and one priced by other code, share the measured menu
    (the solve reads the prices, the measurement does not)."""
    old = record()
    priced = {**old, "settings": {**old["settings"], "prices": [8192, 325, 1258]}}
    repriced = {**old, "settings": {**old["settings"], "prices": [8192, 645, 1258]}}
    assert menu_file(tmp_path, priced["settings"]) == menu_file(tmp_path, repriced["settings"]) \
        == menu_file(tmp_path, old["settings"])
    assert "prices" not in menu_file(tmp_path, priced["settings"])[1]


def test_the_command_writes_each_record_and_refuses_one_without_a_menu(tmp_path, capsys):
    given = tmp_path / "allocation.json"
    given.write_text(json.dumps(record()))
    budget_menu.main([str(given), "--cache-dir", str(tmp_path / "cache")])
    assert (tmp_path / "cache" / "allocations").is_dir() and "-> " in capsys.readouterr().out
    given.write_text(json.dumps({**record(), "signals": None}))
    with pytest.raises(ValueError, match="holds no measured menu"):
        budget_menu.main([str(given), "--cache-dir", str(tmp_path / "cache")])
