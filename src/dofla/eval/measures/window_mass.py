"""The teacher's attention mass outside the window and sinks, per layer (``eval.window_mass``, for a
student with a window)."""
from __future__ import annotations

from dofla.eval import probes
from dofla.eval.measures.ablate_linear import heldout_settings
from dofla.eval.measures.base import Measurement, register


def settings(run, who) -> dict:
    attention = run.cfg.attention
    return {"teacher": run.who_settings["teacher"], **heldout_settings(run), "window": attention.window,
            "sinks": attention.sinks}


def compute(run, who, model) -> dict:
    return probes.window_mass_metrics(run.cfg, run.teacher, run.heldout)


register(Measurement("window_mass", ("window_mass/",),
                     lambda cfg: cfg.eval.window_mass and cfg.attention.window > 0, settings, compute,
                     models=()))
