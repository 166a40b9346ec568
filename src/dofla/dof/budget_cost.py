"""What measuring a menu costs: counted exactly, timed on a sample of heads and scaled to the model.

:func:`measurement_counts` is the count :mod:`dofla.dof.sensitivity` spends on the menu of every KV head:
one baseline student, then per head one student per other option, each run on every calibration batch
and retrieval prompt; one layerwise fit per state (``fit_target="full"``: a state of one M serves every
window) or per option with a state (``"own"``); the baseline has none, so a switched student fits its one
head alone. Its decoder layer forwards: every student runs all L layers on every input, or, with
``reuse_prefix``, the baseline all of them and a student switched at layer l the L - l from l on.

:func:`timed_estimate` measures the whole menu on a few heads of a real teacher and scales each part of
the sample's seconds by its count for the whole model: the time inside the decoder layers per layer
forward (with ``reuse_prefix`` a head of an early layer costs more than one of a late layer, so a per-head
scale would depend on which layers were sampled), the rest of the forwards (embeddings, head and loss: on
SmolLM2's 49,152-token vocabulary a large share) per student forward, the fits per fitting step, and the
rest (building the students) per student. Without ``reuse_prefix`` every forward runs all the layers and
the layers are not timed apart: the whole forward is then the per-forward unit. The interaction check adds one student (and one per repair and switched head).
"""
from __future__ import annotations

from dofla.dof.menu import baseline_index
from dofla.dof.sensitivity import Probe, measure_menu
from dofla.models.adapters.support import get_adapter


def measurement_counts(layers: int, kv_heads: int, menu: list, base: int, batches: int, prompts: int,
                       fit_steps: int, fit_target: str = "full", reuse_prefix: bool = True, width: int = 1) -> dict:
    """The students, forwards, decoder layer forwards and fitting steps of measuring ``menu`` at every unit
    (a KV head, or ``width`` KV heads switched together: with ``width`` = ``kv_heads`` a layer)."""
    per_layer, others, inputs = kv_heads // width, len(menu) - 1, batches + prompts
    states = [o for i, o in enumerate(menu) if i != base and o.state != "none"]
    fitted = len(states if fit_target == "own" else {(o.state, o.M, o.gate) for o in states})
    students = 1 + layers * per_layer * others
    # a unit of layer l runs layers l..L-1: summed over the layers, L + (L - 1) + ... + 1 per unit and option
    switched_layers = per_layer * others * (layers * (layers + 1) // 2 if reuse_prefix else layers * layers)
    return {"students": students, "student_forwards": students * inputs,
            "layer_forwards": inputs * (layers + switched_layers),
            "teacher_forwards": batches + int(fit_steps > 0), "fit_steps": layers * per_layer * fitted * fit_steps}


def timed_estimate(teacher, cfg, tokens, prompts: list, menu: list, sample: list[tuple[int, int]]) -> dict:
    """Measure ``menu`` at the ``sample`` heads of ``teacher`` and scale the seconds to every head.

    Returns the sample's cost, its per-head seconds, its seconds per layer forward, per student forward
    (outside the layers), per fitting step and per student built, and the estimate for the whole model (the exact counts of :func:`measurement_counts` and
    the seconds they scale to)."""
    g = get_adapter(teacher).geometry(teacher.config)
    probe = Probe(teacher, tokens, prompts, cfg)
    setup = probe.cost.seconds  # the teacher's logits and activations, once
    base = baseline_index(menu, g, cfg.context, cfg.kv_bytes)
    width = g.num_kv_heads if cfg.granularity == "layer" else 1
    measure_menu(probe, menu, base, heads=sample, width=width)
    cost = probe.cost
    rates = {"per_layer_forward_seconds": cost.layer_seconds / cost.layer_forwards,
             "per_student_forward_seconds": (cost.forward_seconds - cost.layer_seconds) / cost.student_forwards,
             "per_fit_step_seconds": cost.fit_seconds / max(cost.fit_steps, 1),
             "per_student_build_seconds": (cost.seconds - setup - cost.forward_seconds - cost.fit_seconds)
             / cost.students}
    counts = measurement_counts(g.num_layers, g.num_kv_heads, menu, base, len(probe.batches), len(prompts),
                                cfg.fit_steps, cfg.fit_target, cfg.reuse_prefix, width)
    seconds = setup + sum(rates[f"per_{unit}_seconds"] * counts[key] for unit, key in (
        ("layer_forward", "layer_forwards"), ("student_forward", "student_forwards"), ("fit_step", "fit_steps"),
        ("student_build", "students")))
    return {"sample": {**cost.to_dict(), "heads": len(sample), "setup_seconds": setup},
            "per_head_seconds": (cost.seconds - setup) / len(sample), **rates,
            "estimate": {**counts, "heads": g.num_layers * g.num_kv_heads, "units": g.num_layers * g.num_kv_heads // width,
                         "seconds": seconds}}
