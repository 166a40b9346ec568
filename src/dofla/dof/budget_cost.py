"""What measuring a menu costs: counted exactly, timed on a sample of heads and scaled to the model.

:func:`measurement_counts` is the count :mod:`dofla.dof.sensitivity` spends on the menu of every KV head:
one baseline student, then per head one student per other option, each run on every calibration batch
and retrieval prompt; one layerwise fit per state (``fit_target="full"``: a state of one M serves every
window) or per option with a state (``"own"``); the baseline has none, so a switched student fits its one
head alone. :func:`timed_estimate` measures the whole menu on a few heads
of a real teacher and scales the seconds to all its heads: every head has the same menu, so a head costs
about the same anywhere (the baseline student, measured once, is counted in the sample's heads: a slight
overestimate). The interaction check adds one student (and one per repair and switched head).
"""
from __future__ import annotations

from dofla.dof.menu import baseline_index
from dofla.dof.sensitivity import Probe, measure_menu
from dofla.models.adapters.support import get_adapter


def measurement_counts(layers: int, kv_heads: int, menu: list, base: int, batches: int, prompts: int,
                       fit_steps: int, fit_target: str = "full") -> dict:
    """The students, forwards and fitting steps of measuring ``menu`` at every head (no check)."""
    heads, others = layers * kv_heads, len(menu) - 1
    states = [o for i, o in enumerate(menu) if i != base and o.state != "none"]
    fitted = len(states if fit_target == "own" else {(o.state, o.M, o.gate) for o in states})
    students = 1 + heads * others
    return {"students": students, "student_forwards": students * (batches + prompts),
            "teacher_forwards": batches + int(fit_steps > 0), "fit_steps": heads * fitted * fit_steps}


def timed_estimate(teacher, cfg, tokens, prompts: list, menu: list, sample: list[tuple[int, int]]) -> dict:
    """Measure ``menu`` at the ``sample`` heads of ``teacher`` and scale the seconds to every head.

    Returns the sample's cost, its per-head and per-forward seconds, and the estimate for the whole model
    (seconds and the exact counts of :func:`measurement_counts`)."""
    g = get_adapter(teacher).geometry(teacher.config)
    probe = Probe(teacher, tokens, prompts, cfg)
    setup = probe.cost.seconds  # the teacher's logits and activations, once
    base = baseline_index(menu, g, cfg.context, cfg.kv_bytes)
    measure_menu(probe, menu, base, heads=sample)
    per_head = (probe.cost.seconds - setup) / len(sample)
    heads = g.num_layers * g.num_kv_heads
    counts = measurement_counts(g.num_layers, g.num_kv_heads, menu, base, len(probe.batches), len(prompts),
                                cfg.fit_steps, cfg.fit_target)
    return {"sample": {**probe.cost.to_dict(), "heads": len(sample), "setup_seconds": setup},
            "per_head_seconds": per_head,
            "per_student_forward_seconds": (probe.cost.seconds - setup - probe.cost.fit_seconds)
            / probe.cost.student_forwards,  # building the student included
            "per_fit_step_seconds": probe.cost.fit_seconds / max(probe.cost.fit_steps, 1),
            "estimate": {**counts, "heads": heads, "seconds": setup + per_head * heads}}
