"""Prefix reuse in the budget allocator's measurement (dofla.dof.replay, ``reuse_prefix``) against the plain
path that runs every student whole, on tiny random models of three families (Llama with GQA, GPT-2,
GPT-NeoX) of three layers: the same signals for every head and option (windows, and linear states fitted),
the same plan from the allocator, and fewer decoder layer forwards, as many as counted; a model whose layers
cannot be replayed refused in one sentence and measured plainly; the timed estimate of either path."""
from __future__ import annotations

import pytest
import torch

from dofla.dof.allocator import allocate
from dofla.dof.budget import MemoryBudgetConfig
from dofla.dof.budget_cost import measurement_counts, timed_estimate
from dofla.dof.menu import baseline_index, default_menu
from dofla.dof.replay import decoder_layers, recording, replaying
from dofla.dof.sensitivity import Probe, copy_prompts, measure_menu
from dofla.models import get_adapter
from dofla.models.tiny import TINY_ARCHITECTURES, build_tiny_model

LAYERS = 3
TOKENS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
PROMPTS = copy_prompts(TOKENS)


def _cfg(**kw) -> MemoryBudgetConfig:
    return MemoryBudgetConfig(**{"share": 0.5, "context": 64, "windows": [4, 8], "sinks": 2, "states": [4],
                                 "fit_steps": 3, **kw})


def _measured(teacher, reuse: bool) -> tuple[dict, Probe, list, int]:
    cfg = _cfg(reuse_prefix=reuse)
    menu = default_menu(cfg)
    base = baseline_index(menu, get_adapter(teacher).geometry(teacher.config), cfg.context, cfg.kv_bytes)
    probe = Probe(teacher, TOKENS, PROMPTS, cfg)
    return measure_menu(probe, menu, base), probe, menu, base


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_heads_signals_from_a_replayed_prefix_are_the_whole_students(arch):
    teacher = build_tiny_model(arch, num_layers=LAYERS)
    plain, plain_probe, menu, base = _measured(teacher, reuse=False)
    fast, fast_probe, _, _ = _measured(teacher, reuse=True)
    assert [o.state for o in menu].count("delta") >= 2 and sum(not o.exact for o in menu) > 3
    assert fast["base"] == pytest.approx(plain["base"], rel=1e-6, abs=1e-9)
    assert len(fast["signals"]) == LAYERS * get_adapter(teacher).geometry(teacher.config).num_kv_heads
    for head_fast, head_plain in zip(fast["signals"], plain["signals"], strict=True):
        for s, r in zip(head_fast, head_plain, strict=True):
            assert s == pytest.approx(r, rel=1e-5, abs=1e-7)
    assert fast["signals"] != [[plain["base"]] * len(menu)] * len(fast["signals"])  # the heads do differ
    kv = get_adapter(teacher).geometry(teacher.config).num_kv_heads
    args = (LAYERS, kv, menu, base, 2, len(PROMPTS), 3)
    assert fast_probe.cost.layer_forwards == measurement_counts(*args, reuse_prefix=True)["layer_forwards"]
    assert plain_probe.cost.layer_forwards == measurement_counts(*args, reuse_prefix=False)["layer_forwards"]
    assert fast_probe.cost.layer_forwards < plain_probe.cost.layer_forwards
    assert fast_probe.cost.student_forwards == plain_probe.cost.student_forwards
    assert fast_probe.cost.fit_steps == plain_probe.cost.fit_steps > 0
    assert plain_probe.recorded is None and len(fast_probe.recorded) == 2 + len(PROMPTS)


def test_the_allocator_chooses_the_same_plan_either_way():
    teacher = build_tiny_model("llama", num_layers=LAYERS)
    plain_plan, plain = allocate(teacher, _cfg(reuse_prefix=False), TOKENS, PROMPTS, repair_rounds=1)
    fast_plan, fast = allocate(teacher, _cfg(), TOKENS, PROMPTS, repair_rounds=1)
    assert fast_plan == plain_plan and fast["plan"] == plain["plan"]
    assert sum(fast["values"], []) == pytest.approx(sum(plain["values"], []), rel=1e-5, abs=1e-7)
    assert fast["interaction"] == pytest.approx(plain["interaction"], rel=1e-5, abs=1e-7)
    assert fast["cost"]["students"] == plain["cost"]["students"]
    assert fast["cost"]["layer_forwards"] < plain["cost"]["layer_forwards"]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_the_decoder_layers_are_the_list_that_holds_the_attention_modules(arch):
    model = build_tiny_model(arch, num_layers=LAYERS)
    stack = {"gpt2": lambda m: m.transformer.h, "gpt_neox": lambda m: m.gpt_neox.layers,
             "llama": lambda m: m.model.layers}[arch](model)
    assert [id(layer) for layer in decoder_layers(model)] == [id(layer) for layer in stack]


@torch.no_grad()
def test_a_replayed_prefix_gives_the_recorded_logits_and_leaves_the_layers_as_they_were():
    model = build_tiny_model("gpt_neox", num_layers=LAYERS)
    layers = decoder_layers(model)
    batch = TOKENS[:2]
    with recording(layers) as records:
        whole = model(input_ids=batch).logits
    outputs = [r[0] for r in records]
    calls = []
    handle = layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    with replaying(layers, outputs, LAYERS):  # every layer replayed: the final norm and head alone run
        assert torch.equal(model(input_ids=batch).logits, whole)
        with pytest.raises(RuntimeError, match="the record belongs to another input"):
            model(input_ids=TOKENS[:1])
    handle.remove()
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert torch.equal(model(input_ids=batch).logits, whole)
    with replaying(layers, outputs, 1):  # a changed layer 1 changes the logits: it runs, not the record
        layers[1].mlp.dense_4h_to_h.bias.add_(1.0)
        assert not torch.allclose(model(input_ids=batch).logits, whole)
    assert len(calls) == 2  # the hooks still fire on a replayed layer


def test_a_model_without_a_list_of_decoder_layers_is_one_sentence_and_measures_plainly():
    teacher = build_tiny_model("llama", num_layers=LAYERS)
    teacher.model.layers = torch.nn.Sequential(*teacher.model.layers)  # the layers run, but from no ModuleList
    with pytest.raises(ValueError, match="cannot be replayed; set budget.reuse_prefix=false"):
        _measured(teacher, reuse=True)
    plain, probe, menu, _ = _measured(teacher, reuse=False)
    assert len(plain["signals"]) == LAYERS * 2 and probe.cost.layer_seconds == 0


@pytest.mark.parametrize("reuse", [False, True])
def test_the_timed_estimate_scales_each_part_by_its_count(reuse):
    teacher = build_tiny_model("gpt2", num_layers=LAYERS)
    cfg = _cfg(reuse_prefix=reuse)
    menu = default_menu(cfg)
    estimate = timed_estimate(teacher, cfg, TOKENS, PROMPTS, menu, [(1, 2)])
    base = baseline_index(menu, get_adapter(teacher).geometry(teacher.config), cfg.context, cfg.kv_bytes)
    counts = measurement_counts(LAYERS, 4, menu, base, 2, len(PROMPTS), 3, reuse_prefix=reuse)
    assert {k: estimate["estimate"][k] for k in counts} == counts
    sample = estimate["sample"]
    assert sample["layer_forwards"] == (2 + len(PROMPTS)) * (LAYERS + (len(menu) - 1) * (LAYERS - 1 if reuse else LAYERS))
    assert (estimate["per_layer_forward_seconds"] > 0) == reuse and estimate["per_student_forward_seconds"] > 0
