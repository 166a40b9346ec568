"""One memory budget spent head by head: measure every menu option at every KV head, solve the knapsack,
check the chosen plan on the model, and record all of it (``allocation.json``).

:func:`allocate` refuses a budget below the cheapest plan before any model runs, measures
(:func:`dofla.dof.sensitivity.measure_menu`; the teacher's copying score per KV head beside it,
:func:`~dofla.dof.sensitivity.measure_copying`, which ``copy_weight`` adds to the value), solves exactly (:func:`dofla.dof.knapsack.solve`, each head's
bytes from :func:`dofla.dof.menu.option_bytes`), then re-measures the chosen plan as one student: the
interaction check. Its measured value (the weighted drop of both signals from the baseline student) beside
the sum of the single-head values says how far the heads' gains add up. With ``repair_rounds`` > 0, a
greedy repair follows: each repair step measures every switched head of the best plan found in context (that
plan with the head put back at the baseline), takes the head whose in-context value falls furthest below
its single-head value, puts that in-context value in its place, solves again and measures the new plan
(it stops when the solver returns a plan measured already); the best plan measured is kept.

``state_sizing`` says who picks the size M of each linear state: the measured values (``measured``, the
whole menu's optimum), the unit's degrees of freedom (``dof``: M in proportion to DoF, the scale the values'
choice) or one M for all (``uniform``); the knapsack chooses every unit's form either way
(:mod:`dofla.dof.sizing`).

Two settings serve the ablations: ``granularity="layer"`` makes a layer the unit (its KV heads take one option,
measured switched together: the same budget spent per layer), and ``solver="random"`` draws the plan at the
budget's bytes (:func:`dofla.dof.knapsack.random_choice`) without measuring the menu; its plan is measured.

``allocation=budget`` is registered as an allocation policy here: it reads no DoF and gives no per-layer
dims; the allocate stage calls :func:`allocate` for it (:func:`dofla.stages.allocate.run_budget`).
"""
from __future__ import annotations

from dofla.dof.allocate import ALLOCATION_POLICIES, AllocationPolicy, AllocationRequest
from dofla.dof.budget import MemoryBudgetConfig, budget_bytes, plan_bytes, teacher_kv_bytes
from dofla.dof.config import BUDGET_POLICY
from dofla.dof.knapsack import MIB, Choice, check_instance, random_choice
from dofla.dof.menu import baseline_index, check_menu, default_menu, label, option_bytes
from dofla.dof.first_order import first_order_menu
from dofla.dof.sensitivity import Probe, check_calibration, head_values, measure_copying, measure_menu
from dofla.dof.sizing import check_sizing, option_states, solve_sized
from dofla.models.adapters.support import get_adapter
from dofla.models.plan import StudentPlan


def _per_layer_dims(request: AllocationRequest) -> tuple[list, dict]:
    raise ValueError("allocation=budget chooses a plan per KV head, not feature dims per layer: the allocate "
                     "stage runs it (dofla.stages.allocate.run_budget)")


ALLOCATION_POLICIES.register(BUDGET_POLICY)(AllocationPolicy(BUDGET_POLICY, _per_layer_dims, reads_dof=False))


def allocate(teacher, cfg: MemoryBudgetConfig, tokens, prompts: list, menu: list | None = None,
             repair_rounds: int = 0, measured: dict | None = None,
             unit_dof: list[float] | None = None, known: dict | None = None) -> tuple[StudentPlan, dict]:
    """The plan that spends ``cfg``'s budget best on calibration ``tokens`` (S, L) and retrieval ``prompts``
    (training split), and its JSON-able record. ``measured``: the menu's signals measured before on the same
    teacher, menu, fits and calibration (a record's ``base_signals`` and ``signals``, :func:`menu_signals`),
    so another budget or other weights cost the solve and the check alone. ``unit_dof``: each unit's degrees
    of freedom, which ``state_sizing="dof"`` sizes the linear states by (:mod:`dofla.dof.sizing`). ``known``:
    another menu measured before on the same settings, {"menu": labels, "base", "signals"}: the options it
    shares with this menu are taken from it (:func:`dofla.dof.sensitivity.measure_menu`)."""
    geometry = get_adapter(teacher).geometry(teacher.config)
    local = [i for i, w in enumerate(geometry.layer_windows) if w is not None]
    if local:  # their heads are already a window in the teacher: a menu would offer what they cannot be
        raise ValueError(f"the teacher's layers {local} attend over a sliding window of their own; the budget "
                         "allocator plans teachers whose every layer attends globally, choose such a teacher")
    menu = default_menu(cfg) if menu is None else list(menu)
    check_menu(menu, geometry)
    budget = budget_bytes(cfg, geometry)
    width = geometry.num_kv_heads if cfg.granularity == "layer" else 1  # KV heads that choose together
    count = geometry.num_layers * geometry.num_kv_heads // width
    sizes = [[width * option_bytes(o, geometry, cfg.context, cfg.kv_bytes) for o in menu]] * count
    check_instance([[0.0] * len(menu)] * count, sizes, budget)  # before any model runs
    check_sizing(cfg.state_sizing, option_states(menu), unit_dof, count)
    check_calibration(menu, tokens.shape[1])
    probe = Probe(teacher, tokens, prompts, cfg)
    base = baseline_index(menu, geometry, cfg.context, cfg.kv_bytes)
    unit = _Units(menu, geometry, width, measure_copying(probe, menu, width), cfg.copy_weight)
    if cfg.solver == "random":  # the ablation: nothing of the menu measured, the drawn plan checked alone
        measured = {"base": probe.baseline(unit.plan([base] * count)), "signals": None}
        history = [_check(probe, unit, random_choice(sizes, budget, seed=cfg.seed), measured["base"], cfg)]
    else:
        if measured is None:
            measured = first_order_menu(probe, menu, base, width=width) if cfg.estimator == "first_order" \
                else measure_menu(probe, menu, base, width=width, known=known)
        elif len(measured["signals"]) != count or any(len(unit) != len(menu) for unit in measured["signals"]):
            raise ValueError(f"the measured signals hold {len(measured['signals'])} units of "
                             f"{len(measured['signals'][0])} options, this allocation has {count} of {len(menu)}: "
                             "measure the menu again")
        values = head_values(measured, cfg.kl_weight, cfg.retrieval_weight, unit.copying, cfg.copy_weight)
        history = _solved(probe, unit, base, values, sizes, budget, measured["base"], cfg, repair_rounds, unit_dof)
    best = max(history, key=lambda h: h["measured_value"])
    plan = unit.plan(best["options"])
    return plan, _record(cfg, unit, base, budget, measured, best, history, plan, probe, unit_dof)


def _solved(probe, unit, base: int, values: list, sizes: list, budget: int, reference: dict, cfg,
            repair_rounds: int, unit_dof: list | None) -> list[dict]:
    """The optimum of the measured values (its states sized by ``cfg.state_sizing``), checked on the model,
    then each repair's (module docstring)."""
    def checked(sized) -> dict:
        sizing = {"sizes": sized.sizes and list(sized.sizes), "scale": sized.scale, "candidates": sized.candidates}
        return {**_check(probe, unit, sized.choice, reference, cfg), "sizing": sizing}

    def solved(values):
        return solve_sized(values, sizes, budget, unit.menu, cfg.state_sizing, unit_dof)

    history = [checked(solved(values))]
    for _ in range(repair_rounds):
        values = _repaired(probe, unit, base, values, history, reference, cfg)
        if values is None:
            break
        sized = solved(values)
        if any(h["options"] == list(sized.choice.options) for h in history):
            break  # measured already: the repair has nothing new to try
        history.append(checked(sized))
    return history


def menu_signals(record: dict) -> dict | None:
    """The measured menu of an allocation's record (the ``measured`` :func:`allocate` takes), or None where
    nothing of the menu was measured (a random plan)."""
    signals = record.get("signals")
    return None if signals is None else {"base": record["base_signals"], "signals": signals}


class _Units:
    """The units that choose an option (every KV head, or every layer's KV heads together: ``width``), the
    plan of one option index per unit, and the copying signal's part of a plan's value (the teacher's, so it
    adds up exactly: :func:`dofla.dof.sensitivity.measure_copying`)."""

    def __init__(self, menu: list, geometry, width: int, copying: dict, copy_weight: float):
        self.menu, self.geometry, self.width = menu, geometry, width
        self.copying, self.copy_weight = copying, copy_weight

    def copy_value(self, u: int, o: int) -> float:
        return self.copy_weight * self.copying["scores"][u] * self.copying["keeps"][o]

    def copy_sum(self, options) -> float:
        return sum(self.copy_value(u, o) for u, o in enumerate(options))

    def heads(self, options) -> list[int]:
        """One option index per KV head, in order (layer, KV head)."""
        return [o for o in options for _ in range(self.width)]

    def plan(self, options) -> StudentPlan:
        per_layer, heads = self.geometry.num_kv_heads, self.heads(options)
        return StudentPlan([tuple(self.menu[o] for o in heads[i * per_layer:(i + 1) * per_layer])
                            for i in range(self.geometry.num_layers)])


def _value(signals: dict, base: dict, cfg) -> float:
    """The measured signals' part of a value (the copying part: :meth:`_Units.copy_sum`)."""
    return cfg.kl_weight * (base["kl"] - signals["kl"]) + cfg.retrieval_weight * (base["nll"] - signals["nll"])


def _check(probe: Probe, unit: _Units, choice: Choice, base: dict, cfg) -> dict:
    """The chosen plan measured as one student beside the sum of its units' single-unit values."""
    signals = probe.signals(unit.plan(choice.options))
    measured = _value(signals, base, cfg) + unit.copy_sum(choice.options)
    return {"options": list(choice.options), "status": choice.status, "summed_bytes": choice.bytes,
            "predicted_value": choice.value, "measured_value": measured, "gap": measured - choice.value,
            "kl": signals["kl"], "nll": signals["nll"]}


def _repaired(probe, unit: _Units, base: int, values: list, history: list, reference: dict, cfg) -> list | None:
    """The values with the worst-adding unit's single-unit value replaced by its value in context; None when
    the best plan switches no unit or every unit adds up."""
    best = max(history, key=lambda h: h["measured_value"])
    switched = [h for h, o in enumerate(best["options"]) if o != base]
    if not switched:
        return None
    shortfall = {}
    for h in switched:
        without = list(best["options"])
        without[h] = base
        signals = probe.signals(unit.plan(without))
        in_context = best["measured_value"] - _value(signals, reference, cfg) - unit.copy_sum(without)
        shortfall[h] = (values[h][best["options"][h]] - in_context, in_context)
    worst = max(shortfall, key=lambda h: (shortfall[h][0], -h))
    if shortfall[worst][0] <= 0:
        return None
    values = [list(v) for v in values]
    values[worst][best["options"][worst]] = shortfall[worst][1]
    return values


def _record(cfg, unit: _Units, base, budget, measured, best, history, plan, probe, unit_dof) -> dict:
    """allocation.json: the budget, every head's option with its bytes and its unit's measured gains (none for
    a random plan), the slack, the solver's status, the interaction check (and repairs), how the states were
    sized, and the cost."""
    geometry, menu = unit.geometry, unit.menu
    weights = {"kl": cfg.kl_weight, "retrieval": cfg.retrieval_weight, "copying": cfg.copy_weight}
    heads = []
    for h, o in enumerate(unit.heads(best["options"])):
        layer, kv = divmod(h, geometry.num_kv_heads)
        head = {"layer": layer, "kv_head": kv, "option": label(menu[o]), "plan": menu[o].to_dict(),
                "bytes": option_bytes(menu[o], geometry, cfg.context, cfg.kv_bytes)}
        if measured["signals"] is not None:  # the unit's gains: a layer's heads share their layer's
            signals = measured["signals"][h // unit.width][o]
            head.update(kl_gain=measured["base"]["kl"] - signals["kl"], nll_gain=measured["base"]["nll"] - signals["nll"],
                        value=_value(signals, measured["base"], cfg) + unit.copy_value(h // unit.width, o))
        head["copying"] = unit.copying["heads"][h]
        heads.append(head)
    used = plan_bytes(plan, geometry, cfg.context, cfg.kv_bytes)
    values = None if measured["signals"] is None else \
        head_values(measured, cfg.kl_weight, cfg.retrieval_weight, unit.copying, cfg.copy_weight)
    return {
        "budget": {"bytes": budget, "mib": budget / MIB, "context": cfg.context, "kv_bytes": cfg.kv_bytes,
                   "given": {"mib": cfg.mib, "share": cfg.share},
                   "teacher_kv_bytes": teacher_kv_bytes(geometry, cfg.context, cfg.kv_bytes)},
        "plan_bytes": used, "summed_bytes": best["summed_bytes"], "slack_bytes": budget - used,
        "solver": {"name": "scipy.optimize.milp (HiGHS)" if cfg.solver == "milp" else "random",
                   "status": best["status"]},
        "granularity": cfg.granularity, "weights": weights,
        "state_sizing": {"name": cfg.state_sizing, "unit_dof": unit_dof, **best.get("sizing", {})}, "baseline": label(menu[base]),
        "menu": [label(o) for o in menu], "base_signals": measured["base"], "signals": measured["signals"],
        "copying": unit.copying,
        "heads": heads, "values": values,
        "interaction": {k: best[k] for k in ("predicted_value", "measured_value", "gap", "kl", "nll")},
        "checks": [{k: h[k] for k in ("options", "predicted_value", "measured_value", "gap")} for h in history],
        "cost": probe.cost.to_dict(), "plan": plan.to_list(),
    }
