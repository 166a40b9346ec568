"""The memory-budget allocator on a tiny Llama (two layers of two KV heads, four query heads each): the budget
and the menu's bytes, each head's measured signals against a plain reference, the fitted linear states, the
solved plan within the budget with its record, the interaction check and the repair, and the user errors."""
from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dofla.dof.allocator import allocate, menu_signals
from dofla.dof.budget_cost import measurement_counts, timed_estimate
from dofla.dof.budget import MemoryBudgetConfig, budget_bytes, plan_bytes, teacher_kv_bytes
from dofla.dof.knapsack import MIB, brute_force
from dofla.dof.menu import default_menu, label, option_bytes
from dofla.dof.sizing import nearest_state
from dofla.dof.sensitivity import Probe, copy_prompts, head_values, switched
from dofla.dof.softmax_layers import copying_scores, passkey_prompts
from dofla.eval.longctx import answer_nll
from dofla.models import convert, get_adapter
from dofla.models.plan import ALL, HeadPlan, StudentPlan
from dofla.models.tiny import build_tiny_model
from dofla.train.distill import kl_to_teacher

D, LAYERS, KV = 16, 2, 2
BASE = HeadPlan(window=4, sinks=2)


def _teacher() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=257, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=KV, head_dim=D, intermediate_size=64, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=256, eos_token_id=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _geometry(teacher):
    return get_adapter(teacher).geometry(teacher.config)


def _cfg(**kw) -> MemoryBudgetConfig:
    return MemoryBudgetConfig(**{"share": 0.5, "context": 64, "windows": [4], "sinks": 2, "states": [4, 8],
                                 "fit_steps": 2, **kw})


TOKENS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def allocated(byte_tokenizer):
    prompts = passkey_prompts(byte_tokenizer, 120, 2, seed=0)
    plan, record = allocate(_teacher(), _cfg(), TOKENS, prompts)
    return plan, record, prompts


def test_the_default_menu_is_exact_windows_with_and_without_delta_states_and_pure_states():
    labels = [label(o) for o in default_menu(MemoryBudgetConfig(mib=32))]
    assert len(labels) == 1 + 3 * 5 + 4 and labels[:3] == ["exact", "w64+s4", "w64+s4+delta32"]
    assert labels[-1] == "delta256" and "w1024+s4+delta256" in labels


def test_the_budget_is_bytes_at_its_context_and_the_heads_bytes_bound_the_plans():
    teacher = _teacher()
    g = _geometry(teacher)
    kv = 2 * LAYERS * KV * 64 * D * 4  # a key and a value per KV head, layer and token, in float32
    assert teacher_kv_bytes(g, 64) == kv and budget_bytes(_cfg(share=0.25), g) == kv // 4
    assert budget_bytes(_cfg(share=None, mib=1.5), g) == int(1.5 * MIB)
    menu = default_menu(_cfg())
    for options in itertools.product(range(len(menu)), repeat=2):  # every pair of options in one layer
        plan = StudentPlan([tuple(menu[o] for o in options), (BASE, BASE)])
        summed = sum(option_bytes(h, g, 64) for layer in plan.layers for h in layer)
        assert plan_bytes(plan, g, 64) <= summed
        if len({menu[o] for o in options}) == 2:  # different structures: nothing shared, the sum exactly
            assert plan_bytes(StudentPlan([plan.layers[0], (BASE, menu[0])]), g, 64) == \
                sum(option_bytes(h, g, 64) for h in (*plan.layers[0], BASE, menu[0]))


def test_a_heads_signals_are_the_plain_students():
    """The probe (the teacher's weights shared, its logits kept) against a fresh copy converted and run plainly."""
    teacher, prompts = _teacher(), copy_prompts(TOKENS)
    probe = Probe(teacher, TOKENS, prompts, _cfg(fit_steps=0))
    plan = switched(LAYERS, KV, BASE, (1, 0), HeadPlan(window=4, sinks=2, state="delta", M=8))
    fast = probe.signals(plan)
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", seed=0, plan=plan).eval()
    with torch.no_grad():
        kl = sum(kl_to_teacher(student(b).logits, teacher(b).logits).item() for b in TOKENS.split(2)) / 2
        nll = sum(answer_nll(student, p, a) for p, a in prompts) / len(prompts)
    assert fast["kl"] == pytest.approx(kl, rel=1e-5) and fast["nll"] == pytest.approx(nll, rel=1e-5)
    exact = StudentPlan([(HeadPlan(window=ALL),) * KV] * LAYERS)
    assert probe.signals(exact)["kl"] == pytest.approx(0.0, abs=1e-6)
    assert probe.cost.students == 2 and probe.cost.student_forwards == 2 * (2 + len(prompts))


def test_a_linear_state_is_measured_after_fitting_its_features():
    delta = HeadPlan(state="delta", M=8)
    every = switched(LAYERS, KV, delta, (0, 0), delta)
    unfitted = Probe(_teacher(), TOKENS, [], _cfg(fit_steps=0)).signals(every)["kl"]
    probe = Probe(_teacher(), TOKENS, [], _cfg(fit_steps=20))
    assert probe.signals(every)["kl"] < 0.5 * unfitted
    assert probe.cost.fit_steps == 20 * LAYERS  # one part per layer: its KV heads share a structure


def test_the_plan_is_the_knapsacks_optimum_within_the_budget_and_recorded(allocated):
    plan, record, prompts = allocated
    teacher = _teacher()
    g, menu = _geometry(teacher), default_menu(_cfg())
    budget = budget_bytes(_cfg(), g)
    assert record["budget"]["bytes"] == budget and 0 <= record["slack_bytes"] == budget - plan_bytes(plan, g, 64)
    assert record["plan_bytes"] <= record["summed_bytes"] <= budget
    sizes = [[option_bytes(o, g, 64) for o in menu]] * (LAYERS * KV)
    reference = brute_force(record["values"], sizes, budget)
    assert record["interaction"]["predicted_value"] == pytest.approx(reference.value, abs=1e-9)
    assert [h["option"] for h in record["heads"]] == [label(h) for layer in plan.layers for h in layer]
    assert record["solver"]["status"] == "optimal" and json.loads(json.dumps(record)) == record
    students = 1 + LAYERS * KV * (len(menu) - 1) + 1  # the baseline, each head's other options, the check
    assert record["cost"]["students"] == students
    assert record["cost"]["student_forwards"] == students * (2 + len(prompts)) and record["cost"]["seconds"] > 0
    counts = measurement_counts(LAYERS, KV, menu, menu.index(BASE), 2, len(prompts), 2)
    first = next((i for i, layer in enumerate(plan.layers) if layer != (BASE,) * KV), LAYERS)  # the check's
    # beside the menu: the check's student, and the copying score's teacher pass over the 2 calibration batches
    check = {"students": 1, "student_forwards": 2 + len(prompts), "teacher_forwards": 2,
             "layer_forwards": (2 + len(prompts)) * (LAYERS - first), "fit_steps": 2 * len(_trainable_groups(plan))}
    assert {k: record["cost"][k] for k in counts} == {k: counts[k] + check[k] for k in counts}


def _trainable_groups(plan) -> list:
    """The parts the check's student fits anew: per layer, each structure with a linear state that two or more
    heads share (a single head's state was fitted when it was measured, and is loaded)."""
    return [s for layer in plan.layers for s in {h.structure for h in layer if h.state != "none"}
            if sum(h.structure == s for h in layer) > 1]


def test_one_fit_per_state_serves_every_window_and_loads_as_a_fresh_fit():
    window, pure = HeadPlan(window=4, sinks=2, state="delta", M=8), HeadPlan(state="delta", M=8)
    shared = Probe(_teacher(), TOKENS, [], _cfg(fit_steps=5))
    shared.signals(switched(LAYERS, KV, BASE, (1, 0), window))
    loaded = shared.signals(switched(LAYERS, KV, BASE, (1, 0), pure))
    assert shared.cost.fit_steps == 5
    fresh = Probe(_teacher(), TOKENS, [], _cfg(fit_steps=5)).signals(switched(LAYERS, KV, BASE, (1, 0), pure))
    assert loaded == pytest.approx(fresh, rel=1e-6)
    own = Probe(_teacher(), TOKENS, [], _cfg(fit_steps=5, fit_target="own"))
    own.signals(switched(LAYERS, KV, BASE, (1, 0), window))
    own.signals(switched(LAYERS, KV, BASE, (1, 0), pure))
    assert own.cost.fit_steps == 10


def test_a_timed_sample_scales_to_every_head():
    teacher, prompts = _teacher(), copy_prompts(TOKENS)
    menu = default_menu(_cfg())
    estimate = timed_estimate(teacher, _cfg(), TOKENS, prompts, menu, [(1, 1)])
    sample = estimate["sample"]
    assert sample["students"] == 1 + (len(menu) - 1)
    inputs = 2 + len(prompts)  # the baseline runs both layers, the head of layer 1 its own layer alone
    assert sample["layer_forwards"] == inputs * (LAYERS + (len(menu) - 1) * 1)
    counts = measurement_counts(LAYERS, KV, menu, menu.index(BASE), 2, len(prompts), 2)
    rates = {k: estimate[f"per_{k}_seconds"] for k in ("layer_forward", "student_forward", "fit_step", "student_build")}
    seconds = sample["setup_seconds"] + rates["layer_forward"] * counts["layer_forwards"] + \
        rates["student_forward"] * counts["student_forwards"] + rates["fit_step"] * counts["fit_steps"] + \
        rates["student_build"] * counts["students"]
    assert estimate["estimate"] == {**counts, "heads": LAYERS * KV, "units": LAYERS * KV, "seconds": pytest.approx(seconds)}
    assert rates["layer_forward"] == pytest.approx(sample["layer_seconds"] / sample["layer_forwards"])
    assert 0 < sample["layer_seconds"] < sample["forward_seconds"] < sample["seconds"] and min(rates.values()) > 0
    # a sample of every head spends exactly the counts
    whole = timed_estimate(teacher, _cfg(), TOKENS, prompts, menu, [(i, j) for i in range(LAYERS) for j in range(KV)])
    assert {k: whole["sample"][k] for k in counts} == counts


def test_the_interaction_check_is_the_chosen_plan_measured_again(allocated):
    plan, record, prompts = allocated
    probe = Probe(_teacher(), TOKENS, prompts, _cfg())
    base, chosen = probe.signals(switched(LAYERS, KV, BASE, (0, 0), BASE)), probe.signals(plan)
    measured = (base["kl"] - chosen["kl"]) + (base["nll"] - chosen["nll"])
    assert record["interaction"]["measured_value"] == pytest.approx(measured, rel=1e-6, abs=1e-9)
    assert record["interaction"]["gap"] == pytest.approx(measured - record["interaction"]["predicted_value"])


def test_another_budget_solves_on_the_measured_menu_and_measures_its_plan_alone(allocated):
    """The menu measured at one budget, solved at another: the plan and values of measuring afresh there,
    for the cost of one student (the check)."""
    _, record, prompts = allocated
    cfg = _cfg(share=0.2, kl_weight=2.0)
    fresh_plan, fresh = allocate(_teacher(), cfg, TOKENS, prompts)
    plan, reused = allocate(_teacher(), cfg, TOKENS, prompts, measured=menu_signals(record))
    assert plan == fresh_plan and reused["values"] == fresh["values"] and reused["signals"] == fresh["signals"]
    assert reused["interaction"]["measured_value"] == pytest.approx(fresh["interaction"]["measured_value"], abs=1e-6)
    assert reused["cost"]["students"] == 1 and fresh["cost"]["students"] == record["cost"]["students"]
    assert menu_signals({**record, "signals": None}) is None
    with pytest.raises(ValueError, match="measure the menu again"):
        allocate(_teacher(), _cfg(states=[4]), TOKENS, prompts, measured=menu_signals(record))


def test_the_copying_signal_is_the_teachers_and_chooses_the_exact_heads_alone(allocated):
    """copy_weight: each KV head's copying (its query heads' scores summed) counts for the options that keep
    a key a calibration sequence back (exact here: the window is 4 tokens); with the other weights 0 the
    exact heads are the knapsack's best copiers, and the copying part adds up exactly (no interaction gap)."""
    _, record, prompts = allocated
    teacher = _teacher()
    per_layer = copying_scores(teacher, TOKENS, batch_size=2)
    group = 8 // KV
    heads = [float(per_layer[i][j * group:(j + 1) * group].sum()) for i in range(LAYERS) for j in range(KV)]
    assert record["copying"]["heads"] == pytest.approx(heads, rel=1e-5) and record["copying"]["scores"] == \
        record["copying"]["heads"] and record["copying"]["length"] == TOKENS.shape[1]
    menu = default_menu(_cfg())
    assert record["copying"]["keeps"] == [o.exact for o in menu]
    assert [h["copying"] for h in record["heads"]] == record["copying"]["heads"]
    # the teacher's per-head scores are the mean probability on the copied key: 0 < s < 1 per query head
    assert all(0 < s < group for s in heads) and len(set(heads)) == len(heads)
    cfg = _cfg(share=0.5, kl_weight=0.0, retrieval_weight=0.0, copy_weight=1.0)
    plan, copied = allocate(teacher, cfg, TOKENS, prompts, measured=menu_signals(record))
    values = head_values(menu_signals(record), 0.0, 0.0, record["copying"], 1.0)
    assert sum(copied["values"], []) == pytest.approx(sum(values, [])) and copied["weights"]["copying"] == 1.0
    g = _geometry(teacher)
    sizes = [[option_bytes(o, g, 64) for o in menu]] * (LAYERS * KV)
    best = brute_force(values, sizes, budget_bytes(cfg, g))
    assert copied["interaction"]["predicted_value"] == pytest.approx(best.value)
    exact = [h for h, head in enumerate(copied["heads"]) if head["option"] == "exact"]
    assert copied["interaction"]["predicted_value"] == pytest.approx(sum(heads[h] for h in exact))
    assert copied["interaction"]["gap"] == pytest.approx(0.0, abs=1e-9)
    kept = len(exact)  # as many exact heads as fit, and the best copiers among them
    assert 0 < kept < LAYERS * KV and sorted(exact) == sorted(sorted(range(LAYERS * KV), key=lambda h: -heads[h])[:kept])


@pytest.mark.parametrize("sizing", ["uniform", "dof"])
def test_sized_states_are_the_rules_best_plan_on_the_measured_menu(allocated, sizing):
    """state_sizing on the first allocation's measured menu: every state the plan keeps has its unit's M (one M
    for all, or the M nearest to scale × the unit's DoF), the plan is the brute-force best of every plan that
    rule allows at the candidate's sizes, and the record says how the states were sized."""
    _, record, prompts = allocated
    teacher, dof = _teacher(), [1.0, 9.0, 3.0, 20.0]
    cfg = _cfg(state_sizing=sizing)
    plan, sized = allocate(teacher, cfg, TOKENS, prompts, measured=menu_signals(record),
                           unit_dof=dof if sizing == "dof" else None)
    menu, g = default_menu(cfg), _geometry(teacher)
    info = sized["state_sizing"]
    assert info["name"] == sizing and info["unit_dof"] == (dof if sizing == "dof" else None)
    fixed = info["sizes"]
    if sizing == "dof":
        assert fixed == [nearest_state(info["scale"] * d, [4, 8]) for d in dof]
    else:
        assert len(set(fixed)) == 1 and info["scale"] is None
    states = [o.M if o.state != "none" else None for o in menu]
    for head, m in zip(sized["heads"], fixed):
        assert head["plan"]["state"] == "none" or head["plan"]["M"] == m
    sizes = [[option_bytes(o, g, 64) for o in menu]] * (LAYERS * KV)
    values = record["values"]
    allowed = [[o if states[o] in (None, m) else None for o in range(len(menu))] for m in fixed]
    best = max((sum(values[h][o] for h, o in enumerate(options)), options)
               for options in itertools.product(*[[o for o in a if o is not None] for a in allowed])
               if sum(sizes[h][o] for h, o in enumerate(options)) <= budget_bytes(cfg, g))
    assert sized["interaction"]["predicted_value"] == pytest.approx(best[0])
    assert sized["interaction"]["predicted_value"] <= record["interaction"]["predicted_value"] + 1e-12
    assert max(c["value"] for c in info["candidates"] if c["value"] is not None) == pytest.approx(best[0])
    with pytest.raises(ValueError, match="needs each unit's degrees of freedom"):
        allocate(teacher, _cfg(state_sizing="dof"), TOKENS, prompts, measured=menu_signals(record))


def test_one_switched_head_adds_up_exactly():
    """A budget that lets one head leave the baseline: the plan is a single-head measurement, no gap."""
    teacher = _teacher()
    g = _geometry(teacher)
    cheapest = HeadPlan(window=4, sinks=2, state="delta", M=4)  # the cheapest option above the baseline
    one = 3 * option_bytes(BASE, g, 64) + option_bytes(cheapest, g, 64)
    cfg = _cfg(share=None, mib=one / MIB, pure_states=False, retrieval_weight=0.0)
    plan, record = allocate(teacher, cfg, TOKENS, [])
    assert [label(o) for o in default_menu(cfg)] == ["exact", "w4+s2", "w4+s2+delta4", "w4+s2+delta8"]
    assert sum(h["option"] != label(BASE) for h in record["heads"]) == 1
    assert record["interaction"]["gap"] == pytest.approx(0.0, abs=1e-9)


def test_a_budget_above_everything_keeps_every_head_exact_on_kl_and_repairs_keep_the_best():
    plan, record = allocate(_teacher(), _cfg(share=2.0, retrieval_weight=0.0), TOKENS, [], repair_rounds=2)
    assert all(max(v) == v[[label(o) for o in default_menu(_cfg())].index(h["option"])]
               for v, h in zip(record["values"], record["heads"]))  # nothing binds: each head's best option
    assert all(h.exact for layer in plan.layers for h in layer)
    assert record["interaction"]["measured_value"] == max(c["measured_value"] for c in record["checks"])


def test_a_repair_that_returns_a_plan_measured_already_stops():
    """A budget that fits one plan alone (every head at the smallest state): the repair re-solves to it."""
    teacher = _teacher()
    smallest = HeadPlan(state="delta", M=4)
    budget = LAYERS * KV * option_bytes(smallest, _geometry(teacher), 64)
    plan, record = allocate(teacher, _cfg(share=None, mib=budget / MIB), TOKENS, [], repair_rounds=3)
    assert all(h == smallest for layer in plan.layers for h in layer) and record["slack_bytes"] == 0
    assert len(record["checks"]) == 1 and record["cost"]["students"] == 1 + LAYERS * KV * 5 + 1 + LAYERS * KV


def test_a_budget_below_the_cheapest_plan_is_refused_before_any_measurement():
    with pytest.raises(ValueError, match=r"below the cheapest plan's .* MiB"):
        allocate(_teacher(), _cfg(share=None, mib=1e-4), TOKENS[:, :3], [])  # too short to measure: never reached


def test_a_teacher_with_sliding_window_layers_is_one_sentence():
    with pytest.raises(ValueError, match=r"the teacher's layers \[1\] attend over a sliding window of their own"):
        allocate(build_tiny_model("qwen2"), _cfg(), TOKENS, [])


def test_calibration_shorter_than_a_window_is_one_sentence():
    with pytest.raises(ValueError, match="cannot tell a window of 6 tokens"):
        allocate(_teacher(), _cfg(), TOKENS[:, :6], [])


@pytest.mark.parametrize("kw, sentence", [
    ({"mib": 8.0}, "exactly one of them"),
    ({"share": None}, "exactly one of them"),
    ({"share": -0.1}, "positive share of the teacher's KV cache"),
    ({"context": 0}, "context=0 must be a positive number of tokens"),
    ({"exact": False, "windows": []}, "needs an option without a linear state"),
    ({"kl_weight": 0.0, "retrieval_weight": 0.0}, "not all 0"),
    ({"copy_weight": -1.0}, "copy_weight=-1.0 must be ≥ 0"),
    ({"states": [0]}, "positive feature dims M"),
    ({"fit_target": "window"}, "must be 'full'"),
    ({"granularity": "group"}, "must be 'head'"),
    ({"solver": "greedy"}, "must be 'milp'"),
    ({"state_sizing": "largest"}, "must be 'measured'"),
])
def test_a_wrong_budget_is_one_sentence(kw, sentence):
    with pytest.raises(ValueError, match=sentence):
        _cfg(**kw)


def test_per_layer_every_kv_head_of_a_layer_takes_its_layers_option_and_the_value_is_the_layer_switched(byte_tokenizer):
    """granularity=layer: the knapsack's unit is a layer (its KV heads' bytes summed), each option measured as
    the whole layer switched, the optimum over layers, and a KV-head count fewer students."""
    prompts = passkey_prompts(byte_tokenizer, 120, 2, seed=0)
    teacher, cfg = _teacher(), _cfg(granularity="layer")
    plan, record = allocate(teacher, cfg, TOKENS, prompts)
    g, menu = _geometry(teacher), default_menu(cfg)
    assert all(len(set(layer)) == 1 for layer in plan.layers) and record["granularity"] == "layer"
    assert len(record["values"]) == LAYERS
    sizes = [[KV * option_bytes(o, g, 64) for o in menu]] * LAYERS
    reference = brute_force(record["values"], sizes, budget_bytes(cfg, g))
    assert record["interaction"]["predicted_value"] == pytest.approx(reference.value, abs=1e-9)
    # a layer's value is the student with that whole layer switched, measured plainly
    probe = Probe(teacher, TOKENS, prompts, _cfg(granularity="layer", reuse_prefix=False))
    base = probe.signals(StudentPlan([(BASE,) * KV] * LAYERS))
    o = next(i for i, option in enumerate(menu) if option.exact)
    whole = probe.signals(switched(LAYERS, KV, BASE, (1, 0), menu[o], width=KV))
    assert record["values"][1][o] == pytest.approx((base["kl"] - whole["kl"]) + (base["nll"] - whole["nll"]), abs=1e-5)
    students = 1 + LAYERS * (len(menu) - 1) + 1
    counts = measurement_counts(LAYERS, KV, menu, menu.index(BASE), 2, len(prompts), 2, width=KV)
    assert record["cost"]["students"] == students == counts["students"] + 1
    assert all(h["value"] == record["values"][h["layer"]][menu.index(plan.layers[h["layer"]][0])]
               for h in record["heads"])


def test_a_random_plan_measures_no_menu_only_itself_and_follows_its_seed(byte_tokenizer):
    prompts = passkey_prompts(byte_tokenizer, 120, 2, seed=0)
    teacher = _teacher()
    plans = [allocate(teacher, _cfg(solver="random", seed=seed), TOKENS, prompts) for seed in (0, 0, 3)]
    (plan, record), (again, _), (other, _) = plans
    assert plan == again and plan != other
    assert record["values"] is None and record["solver"]["name"] == "random"
    assert record["cost"]["students"] == 2  # the baseline and the drawn plan
    assert record["plan_bytes"] <= record["budget"]["bytes"] and "value" not in record["heads"][0]
    measured = Probe(teacher, TOKENS, prompts, _cfg(reuse_prefix=False)).signals(plan)
    assert record["interaction"]["kl"] == pytest.approx(measured["kl"], abs=1e-5)
