"""Each menu option's signals at each unit predicted to first order from one backward of the baseline student.

The measured path (:func:`dofla.dof.sensitivity.measure_menu`) runs a whole student per unit and option. Here
the baseline student runs once per calibration batch and prompt with the gradient of its signal (the summed
KL to the teacher's logits, or the answer's nats) kept at every attention module's output. Switching unit u
of layer l to option o changes only that layer's attention output, by Δ = out_o − out_base, computed by
running layer l's attention module of the switched student on the baseline's recorded inputs of that module
(one attention module, not the model). The signal then moves by ⟨∂signal/∂out_l, Δ⟩ to first order, the
Taylor term "attribution patching" uses to rank model components. Its cost: one forward and backward of
the baseline per input, and per unit and option one attention module per input, instead of a whole
student's forward from layer l: tens of times less on a deep model.

It is an approximation: the later layers respond linearly to Δ in it, and a head that changes the attention
a lot (a window made exact, on a prompt that needs the far key) may move a signal by more or less than its
first-order term. The allocator therefore still measures the chosen plan as one student (the interaction
check) and can repair it (``repair_rounds``); :func:`first_order_check` compares it with the measured values.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch
from scipy.stats import spearmanr

from dofla.dof.sensitivity import Probe, switched, units
from dofla.eval.longctx import answer_nats
from dofla.models.adapters.support import get_adapter
from dofla.train.distill import kl_to_teacher


def _output(out):
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def _traced(model):
    """Yields (calls, outputs): per attention module, the (args, kwargs) and the output of each call inside the
    block, the outputs keeping their gradient; the embeddings' output is made to require one, so every later
    activation has a gradient path although no weight trains."""
    modules = get_adapter(model).attention_modules(model)
    calls, outputs = [[] for _ in modules], [[] for _ in modules]

    def keep(i: int, module, args, out) -> None:  # returns None: the output itself is left as it is
        _output(out).retain_grad()
        outputs[i].append(_output(out))

    handles = [model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_())]
    for i, module in enumerate(modules):
        handles.append(module.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: calls[i].append((args, kwargs)), with_kwargs=True))
        handles.append(module.register_forward_hook(functools.partial(keep, i)))
    try:
        yield calls, outputs
    finally:
        for handle in handles:
            handle.remove()


def _signal(model, probe: Probe, n: int, tokens, other) -> torch.Tensor:
    """Input ``n``'s summed KL (a calibration batch) or answer nats (a prompt), with its graph, as
    :meth:`Probe._forward` computes them."""
    if n < len(probe.batches):
        return kl_to_teacher(model(input_ids=tokens, use_cache=False).logits, other) * tokens.numel()
    return answer_nats(model, tokens.to(probe.device), other.to(probe.device))


def first_order_menu(probe: Probe, menu: list, base: int, width: int = 1) -> dict:
    """:func:`~dofla.dof.sensitivity.measure_menu`'s result (the all-baseline student's signals, measured, and
    each option's at each unit), each switched unit's signals predicted to first order (module docstring)."""
    g = probe.geometry
    start = time.perf_counter()
    base_plan = switched(g.num_layers, g.num_kv_heads, menu[base], (0, 0), menu[base])
    model = probe.student(base_plan)
    inputs = [(b, t) for b, t in zip(probe.batches, probe.targets)] + list(probe.prompts)
    for p in model.parameters():
        p.requires_grad_(False)
    sums, traces = [], []
    for n, (tokens, other) in enumerate(inputs):
        with torch.enable_grad(), _traced(model) as (calls, outputs):
            signal = _signal(model, probe, n, tokens, other)
            signal.backward()
        sums.append(signal.item())
        traces.append([(c[0], o[0].detach(), o[0].grad) for c, o in zip(calls, outputs)])
    probe.cost.student_forwards += len(inputs)
    probe.cost.layer_forwards += len(inputs) * g.num_layers
    tokens = sum(b.numel() for b in probe.batches)
    prompts = max(len(probe.prompts), 1)

    def signals(terms: list[float]) -> dict:
        return {"kl": sum(terms[:len(probe.batches)]) / tokens, "nll": sum(terms[len(probe.batches):]) / prompts}

    reference = signals(sums)
    result = []
    with torch.no_grad():
        for unit in units(g, width):
            layer = unit[0]
            row = []
            for o, option in enumerate(menu):
                if o == base:
                    row.append(reference)
                    continue
                student = probe.student(switched(g.num_layers, g.num_kv_heads, menu[base], unit, option, width))
                module = get_adapter(student).attention_modules(student)[layer]
                terms = []
                for value, trace in zip(sums, traces):
                    (args, kwargs), out, grad = trace[layer]
                    delta = _output(module(*args, **kwargs)) - out
                    terms.append(value + (grad * delta).sum().item())
                row.append(signals(terms))
            result.append(row)
    probe.cost.seconds += time.perf_counter() - start
    return {"base": reference, "signals": result}


def first_order_check(predicted: dict, measured: dict, base: int, weights: tuple[float, float] = (1.0, 1.0)) -> dict:
    """How well first-order values stand in for measured ones: Spearman's rank correlation over every unit and
    non-baseline option (``base``: the baseline's index in the menu) of the weighted value, and the mean
    absolute error of each signal's change."""
    def changes(menu: dict, key: str) -> list[float]:
        return [s[key] - menu["base"][key] for row in menu["signals"] for o, s in enumerate(row) if o != base]

    def values(menu: dict) -> list[float]:
        return [-(weights[0] * kl + weights[1] * nll) for kl, nll in zip(changes(menu, "kl"), changes(menu, "nll"))]

    rho = spearmanr(values(predicted), values(measured)).statistic
    error = {k: sum(abs(a - b) for a, b in zip(changes(predicted, k), changes(measured, k))) / len(changes(measured, k))
             for k in ("kl", "nll")}
    return {"spearman": float(rho), "kl_abs_error": error["kl"], "nll_abs_error": error["nll"]}
