"""The first-order estimate of the budget allocator's menu (dofla.dof.first_order) on the tiny Llama of
test_budget_allocator, in float64: its baseline is the measured baseline, each predicted change is the
derivative of the measured signal along the switched head's output change (a finite difference of the plain
forward), the allocator runs on it and still measures its plan, and the check compares it with the
measured menu."""
from __future__ import annotations

import pytest
import torch

from dofla.dof.allocator import allocate
from dofla.dof.first_order import first_order_check, first_order_menu
from dofla.dof.budget import MemoryBudgetConfig
from dofla.dof.menu import baseline_index, default_menu
from dofla.dof.sensitivity import Probe, copy_prompts, measure_menu, switched
from dofla.dof.softmax_layers import passkey_prompts
from dofla.models.adapters.support import get_adapter
from dofla.models.tiny import TINY_ARCHITECTURES, build_tiny_model
from tests.component.test_budget_allocator import KV, LAYERS, TOKENS, _cfg, _geometry, _teacher

CFG = dict(states=[4], pure_states=False, fit_steps=2)


@pytest.fixture(scope="module")
def menus(byte_tokenizer):
    teacher = _teacher().double()
    prompts = passkey_prompts(byte_tokenizer, 120, 2, seed=0)
    cfg = _cfg(**CFG)
    menu = default_menu(cfg)
    base = baseline_index(menu, _geometry(teacher), cfg.context, cfg.kv_bytes)
    predicted_probe = Probe(teacher, TOKENS, prompts, cfg)
    predicted = first_order_menu(predicted_probe, menu, base)
    measured = measure_menu(Probe(teacher, TOKENS, prompts, cfg), menu, base)
    return teacher, prompts, cfg, menu, base, predicted, measured, predicted_probe


def test_the_baseline_is_measured_and_every_unit_and_option_is_predicted(menus):
    teacher, prompts, cfg, menu, base, predicted, measured, probe = menus
    assert predicted["base"] == pytest.approx(measured["base"], rel=1e-9)
    assert len(predicted["signals"]) == LAYERS * KV and all(len(row) == len(menu) for row in predicted["signals"])
    assert all(row[base] == predicted["base"] for row in predicted["signals"])
    # one forward and backward per calibration batch and prompt; per unit and option one attention module
    assert probe.cost.student_forwards == len(probe.batches) + len(prompts)
    assert probe.cost.layer_forwards == (len(probe.batches) + len(prompts)) * LAYERS


def _shifted_signals(probe: Probe, plan, layer: int, delta: list, eps: float) -> dict:
    """The plain measured signals of ``plan``'s student with ``eps`` × ``delta[n]`` added to layer ``layer``'s
    attention output on input n."""
    model = probe.student(plan)
    module = get_adapter(model).attention_modules(model)[layer]
    calls = iter(range(len(delta)))

    def shift(m, args, out):
        d = eps * delta[next(calls)]
        return (out[0] + d, *out[1:]) if isinstance(out, tuple) else out + d

    handle = module.register_forward_hook(shift)
    try:
        inputs = [(b, t) for b, t in zip(probe.batches, probe.targets)] + list(probe.prompts)
        with torch.no_grad():
            terms = [probe._forward(model, [], 0, n, *pair) for n, pair in enumerate(inputs)]
    finally:
        handle.remove()
    return {"kl": sum(terms[:len(probe.batches)]) / sum(b.numel() for b in probe.batches),
            "nll": sum(terms[len(probe.batches):]) / len(probe.prompts)}


def _derivative(probe: Probe, menu: list, base: int, at: tuple[int, int], o: int, eps: float = 1e-2) -> dict:
    """Each signal's central difference along Δ, the change of layer ``at[0]``'s attention output when KV head
    ``at`` takes option ``o``, Δ taken on the baseline's own inputs of that module (the plain measured path)."""
    g = probe.geometry
    layer = at[0]
    base_plan = switched(g.num_layers, g.num_kv_heads, menu[base], (0, 0), menu[base])
    model = probe.student(base_plan)
    module = get_adapter(model).attention_modules(model)[layer]
    calls, recorded = [], []
    hooks = [module.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True),
             module.register_forward_hook(lambda m, a, out: recorded.append(out[0] if isinstance(out, tuple) else out))]
    inputs = [(b, t) for b, t in zip(probe.batches, probe.targets)] + list(probe.prompts)
    with torch.no_grad():
        for n, pair in enumerate(inputs):
            probe._forward(model, [], 0, n, *pair)
    for hook in hooks:
        hook.remove()
    student = probe.student(switched(g.num_layers, g.num_kv_heads, menu[base], at, menu[o]))
    other = get_adapter(student).attention_modules(student)[layer]
    with torch.no_grad():
        outs = [other(*a, **k) for a, k in calls]
    delta = [(out[0] if isinstance(out, tuple) else out) - ref for out, ref in zip(outs, recorded)]
    up, down = (_shifted_signals(probe, base_plan, layer, delta, s * eps) for s in (1, -1))
    return {key: (up[key] - down[key]) / (2 * eps) for key in ("kl", "nll")}


@pytest.mark.parametrize("option", ["exact", "state"])
def test_each_predicted_change_is_the_derivative_along_the_heads_output_change(menus, option):
    """Central differences with eps = 1e-2: the losses are float32 (kl_to_teacher, cross_entropy of .float()
    logits), so smaller steps measure rounding; a state's larger Δ leaves some curvature (hence 2 %)."""
    teacher, prompts, cfg, menu, base, predicted, measured, probe = menus
    o = next(i for i, m in enumerate(menu) if (m.exact if option == "exact" else m.state != "none"))
    derivative = _derivative(probe, menu, base, (1, 1), o)
    for key in ("kl", "nll"):
        assert predicted["signals"][1 * KV + 1][o][key] - predicted["base"][key] == pytest.approx(derivative[key], rel=2e-2)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_family_gets_the_measured_baseline_and_the_derivative(arch):
    """GPT-2, GPT-NeoX and the GQA Llama: their attention modules' calls replayed, their gradients kept."""
    teacher = build_tiny_model(arch, num_layers=2).double()
    cfg = MemoryBudgetConfig(share=0.5, context=64, windows=[4], sinks=2, states=[4], pure_states=False, fit_steps=2)
    menu = default_menu(cfg)
    base = baseline_index(menu, get_adapter(teacher).geometry(teacher.config), cfg.context, cfg.kv_bytes)
    probe = Probe(teacher, TOKENS, copy_prompts(TOKENS), cfg)
    predicted = first_order_menu(probe, menu, base)
    assert predicted["base"] == pytest.approx(measure_menu(Probe(teacher, TOKENS, copy_prompts(TOKENS), cfg), menu,
                                                           base)["base"], rel=1e-9)
    exact = next(i for i, m in enumerate(menu) if m.exact)
    derivative = _derivative(probe, menu, base, (1, 0), exact)
    kv = get_adapter(teacher).geometry(teacher.config).num_kv_heads
    for key in ("kl", "nll"):
        assert predicted["signals"][kv][exact][key] - predicted["base"][key] == pytest.approx(derivative[key], rel=2e-2)


def test_the_allocator_solves_on_it_and_still_measures_its_plan(menus, byte_tokenizer):
    teacher, prompts, cfg, menu, base, predicted, measured, probe = menus
    plan, record = allocate(teacher, _cfg(**CFG, estimator="first_order"), TOKENS, prompts)
    chosen = [o for row in plan.layers for o in row]
    assert record["plan_bytes"] <= record["budget"]["bytes"]
    flat = lambda menu: [s[k] for row in menu for s in row for k in ("kl", "nll")]  # noqa: E731
    assert flat(record["signals"]) == pytest.approx(flat(predicted["signals"]))  # the menu it solved on
    # the check measured the chosen plan as one student, as with measured values
    check = Probe(teacher, TOKENS, prompts, cfg).signals(plan)
    assert record["interaction"]["kl"] == pytest.approx(check["kl"], rel=1e-9)
    fewer = allocate(teacher, _cfg(**CFG), TOKENS, prompts)[1]["cost"]
    assert record["cost"]["layer_forwards"] < fewer["layer_forwards"] and len(chosen) == LAYERS * KV


def test_the_check_compares_predicted_with_measured_values(menus):
    teacher, prompts, cfg, menu, base, predicted, measured, probe = menus
    same = first_order_check(measured, measured, base)
    assert same == {"spearman": pytest.approx(1.0), "kl_abs_error": 0.0, "nll_abs_error": 0.0}
    got = first_order_check(predicted, measured, base)
    assert -1 <= got["spearman"] <= 1 and got["kl_abs_error"] > 0
