"""A menu that extends one measured before (dofla.dof.sensitivity.measure_menu's ``known``) on a tiny Llama of
three layers: the options both menus hold are taken over, the new ones measured, and every signal is what
measuring the larger menu whole gives; a measurement whose baseline measured otherwise lends nothing."""
from __future__ import annotations

import pytest
import torch

from dofla.dof.budget import MemoryBudgetConfig
from dofla.dof.menu import baseline_index, default_menu, label
from dofla.dof.menu_cache import earlier_menu, menu_file, menu_labels
from dofla.dof.sensitivity import Probe, copy_prompts, measure_menu
from dofla.models import get_adapter
from dofla.models.tiny import build_tiny_model
from dofla.record import write_json

LAYERS = 3
TOKENS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
PROMPTS = copy_prompts(TOKENS)


def _cfg(**kw) -> MemoryBudgetConfig:
    return MemoryBudgetConfig(**{"share": 0.5, "context": 64, "windows": [4], "sinks": 2, "states": [4],
                                 "pure_states": False, "fit_steps": 3, **kw})


def _measure(teacher, cfg, known=None) -> tuple[dict, Probe, list]:
    menu = default_menu(cfg)
    base = baseline_index(menu, get_adapter(teacher).geometry(teacher.config), cfg.context, cfg.kv_bytes)
    probe = Probe(teacher, TOKENS, PROMPTS, cfg)
    return measure_menu(probe, menu, base, known=known), probe, menu


@pytest.fixture(scope="module")
def measured():
    """The tiny teacher and its menu of exact, a window of 4 and that window with a state, measured."""
    teacher = build_tiny_model("llama", num_layers=LAYERS)
    small, _, menu = _measure(teacher, _cfg())
    return teacher, {"menu": [label(o) for o in menu], **small}


def test_an_extended_menu_measures_its_new_options_alone_and_matches_the_whole_measurement(measured):
    teacher, known = measured
    larger = _cfg(windows=[4, 8])
    whole, whole_probe, menu = _measure(teacher, larger)
    extended, probe, _ = _measure(teacher, larger, known=known)
    units = len(whole["signals"])
    shared = [o for o in menu if label(o) in known["menu"]]
    assert len(shared) == 3 and len(menu) == 5  # exact, the window of 4 and it with a state: both menus hold them
    assert probe.cost.reused == units * (len(shared) - 1)  # the baseline is measured again, not taken
    assert probe.cost.students == whole_probe.cost.students - probe.cost.reused
    assert extended["base"] == pytest.approx(whole["base"], rel=1e-6)
    for got, want in zip(extended["signals"], whole["signals"], strict=True):
        for s, r in zip(got, want, strict=True):
            assert s == pytest.approx(r, rel=1e-5, abs=1e-7)
    index = {label(o): i for i, o in enumerate(menu)}
    for n, row in enumerate(known["signals"]):  # the shared options' signals are the earlier measurement's
        for name, signals in zip(known["menu"], row):
            assert extended["signals"][n][index[name]] == signals


def test_a_measurement_of_another_baseline_lends_nothing(measured):
    teacher, known = measured
    moved = {**known, "base": {"kl": known["base"]["kl"] * 1.5, "nll": known["base"]["nll"]}}
    again, probe, menu = _measure(teacher, _cfg(windows=[4, 8]), known=moved)
    assert probe.cost.reused == 0
    assert probe.cost.students == 1 + len(again["signals"]) * (len(menu) - 1)  # every option measured
    assert again["base"] == pytest.approx(known["base"], rel=1e-6)  # the baseline itself is the same


def _settings(**budget) -> dict:
    return {"teacher": "t", "calibration": "sha256:0", "repair_rounds": 0, "prices": [1, 2],
            "budget": {"share": 0.1, "exact": True, "windows": [64], "sinks": 4, "states": [64],
                       "pure_states": False, "fit_steps": 40, **budget}}


def test_the_earlier_menu_is_the_one_of_the_same_settings_sharing_the_most_options(tmp_path):
    measured = {"base": {"kl": 1.0, "nll": 2.0}, "signals": [[{"kl": 0.5, "nll": 1.0}] * 3]}
    for settings in (_settings(), _settings(states=[32]), _settings(fit_steps=10, windows=[64, 1024])):
        path, key = menu_file(tmp_path, settings)
        write_json(path, {"settings": key, "measured": measured, "seconds": 60.0})
    _, key = menu_file(tmp_path, _settings(windows=[64, 1024]))
    found = earlier_menu(tmp_path, key)
    assert found["menu"] == ["exact", "w64+s4", "w64+s4+delta64"] == menu_labels(menu_file(tmp_path, _settings())[1])
    assert found["shared"] == found["menu"] and found["seconds"] == 60.0 and found["signals"] == measured["signals"]
    _, other = menu_file(tmp_path, _settings(fit_steps=20, windows=[64, 1024]))  # other fits: nothing shared
    assert earlier_menu(tmp_path, other) is None
    _, same = menu_file(tmp_path, _settings())  # its own file is not an earlier menu
    assert earlier_menu(tmp_path, same)["file"] != menu_file(tmp_path, _settings())[0].name
