"""The recorded students' decode memory as the current code holds it.

A window (the last W tokens and the sinks, exact softmax) once held its keys and values once per *query*
head; it now holds each KV head's once, as the teacher's cache does, so on SmolLM2 (three query heads per KV
head) a plain window takes a third of what it took, and a hybrid's window (before a linear or delta state,
whose key features stay per query head) less. Records measured before that change keep the bytes they
measured. For a record whose student holds a window (the window and hybrid presets, every
``allocation=budget`` plan) this module restates its decode memory as its plan's bytes under the current code:
:meth:`dofla.models.plan.StudentPlan.state_bytes`, which a decode measurement of the same student equals
(``tests/component/test_mixed_heads.py``, ``tests/component/test_decode_memory.py``). Students without a window
keep their records' bytes: nothing they hold changed.
"""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

from dofla.models import ConversionSpec, StudentPlan, expand
from dofla.report import RunRecord
from studies.tables import markdown

TEACHER = "smollm2_135m"  # the model config whose geometry follows: the records' teacher
LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64  # SmolLM2-135M: 9 query heads over 3 KV heads of dim 64
SMOLLM2 = SimpleNamespace(num_layers=LAYERS, num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS, layer_windows=None)
MEMORY = re.compile(r"^memory/student/decode_mib/T(\d+)$")
RECORDED = "memory/student/recorded_mib/T{}"  # the restated record keeps what it measured under this name


def _budget_dim(config: dict) -> int:
    """The feature budget of a run with no allocation record: ``budget.value``, else the head dim times
    ``budget.multiple``."""
    budget = config.get("budget", {})
    return int(budget.get("value") or HEAD_DIM * budget.get("multiple", 1.0))


def student_plan(record: RunRecord) -> StudentPlan | None:
    """The plan per KV head a record's student of SmolLM2-135M decodes with, where it holds a window; else None
    (and for another teacher). A run's allocation plan, else the conversion its config and allocation describe
    (of ``softmax_layers`` = k exact layers, the first k: which ones does not change the bytes)."""
    if record.config.get("model", {}).get("name") != TEACHER:
        return None
    if record.allocation and "plan" in record.allocation:
        plan = StudentPlan.from_list(record.allocation["plan"])
    else:
        c = record.config
        attention, exact = c.get("attention", {}), c.get("allocation", {}).get("softmax_layers") or 0
        if not attention.get("window") or c.get("feature_map", {}).get("name") == "softmax":
            return None
        dims = (record.allocation or {}).get("dims") or [_budget_dim(c)] * LAYERS
        spec = ConversionSpec(dims=dims, feature_map=c["feature_map"]["name"], window=attention["window"],
                              attention=attention["name"], sinks=attention["sinks"], gate=attention["gate"],
                              softmax_layers=list(range(exact)) if isinstance(exact, int) else list(exact),
                              linear_scale=attention["linear_scale"])
        plan = expand(spec, SMOLLM2)
    windowed = any(not h.exact and h.window for layer in plan.layers for h in layer)
    return plan if windowed else None


def restated(record: RunRecord) -> RunRecord:
    """``record`` with its student's decode memory at each measured context as the current code holds it
    (its measured bytes kept under ``memory/student/recorded_mib/T<context>``); unchanged where nothing
    changed."""
    plan = student_plan(record)
    if plan is None:
        return record
    metrics = dict(record.metrics)
    for key, value in record.metrics.items():
        if m := MEMORY.match(key):
            now = plan.state_bytes(GROUP, HEAD_DIM, int(m[1])) / 2**20
            if round(now, 6) != round(value, 6):
                metrics[key], metrics[RECORDED.format(m[1])] = now, value
    return dataclasses.replace(record, metrics=metrics)


def window_memory_table(records: list[RunRecord], context: int = 8192) -> str:
    """One row per student whose recorded decode memory the current code restates: its MiB at ``context`` as
    recorded and as held now."""
    rows, seen = [], set()
    for record in records:
        now = restated(record)
        key = f"memory/student/decode_mib/T{context}"
        if RECORDED.format(context) not in now.metrics:
            continue
        budget = (record.allocation or {}).get("budget")
        name = f"allocated: {budget['mib']:.1f} MiB budget" if isinstance(budget, dict) else f"`{record.experiment}`"
        if name in seen:
            continue
        seen.add(name)
        recorded, held = now.metrics[RECORDED.format(context)], now.metrics[key]
        rows.append((recorded, [name, f"{recorded:.1f}", f"{held:.1f}", f"{held / recorded:.2f}"]))
    header = ["student", f"decode MiB at {context:,} tokens, recorded", "held now (a window's keys once per KV head)",
              "now ÷ recorded"]
    return markdown(header, [row for _, row in sorted(rows, key=lambda r: r[0])]) if rows else ""


def _counts(plan: StudentPlan) -> tuple[int, int, int]:
    """(exact heads, plain window heads, heads with a linear state) of a plan."""
    heads = [h for layer in plan.layers for h in layer]
    return (sum(h.exact for h in heads), sum(not h.exact and h.state == "none" for h in heads),
            sum(h.state != "none" for h in heads))


def _unpriced(settings: dict) -> dict:
    """An allocation's settings less the options' prices (records from before the prices were keyed lack them)."""
    return {k: v for k, v in settings.items() if k != "prices"}


def window_price_table(allocations: list[RunRecord], trained: list[RunRecord], label) -> str:
    """Each allocation solved at a window's current price (its ``plan_bytes`` are what the current code counts)
    beside the trained run's allocation of the same budget, data order and measured menu, which priced a window
    per query head: what each keeps, its bytes as held now, and its value as the solve predicted it (the
    single heads' gains summed) and as the allocator's check measured it before any training (KL and
    passkey-answer gains; higher is better)."""
    rows = []
    for now in allocations:
        a = now.allocation or {}
        if "plan" not in a or "interaction" not in a:
            continue
        plan = StudentPlan.from_list(a["plan"])
        if plan.state_bytes(GROUP, HEAD_DIM, a["budget"]["context"]) != a["plan_bytes"]:
            continue  # priced before the change
        before = [r for r in trained if r.seed == now.seed and r.allocation and r.allocation.get("values") == a["values"]
                  and r.allocation["budget"] == a["budget"]
                  and _unpriced(r.allocation["settings"]) == _unpriced(a["settings"])]
        for name, record in (("priced per query head (trained)", before[0] if before else None),
                             ("priced per KV head (current)", now)):
            if record is None:
                continue
            chosen = StudentPlan.from_list(record.allocation["plan"])
            check = record.allocation["interaction"]
            exact, windows, states = _counts(chosen)
            mib = chosen.state_bytes(GROUP, HEAD_DIM, a["budget"]["context"]) / 2**20
            where = ", ".join(f"{i}.{j}" for i, layer in enumerate(chosen.layers) for j, h in enumerate(layer) if h.exact)
            rows.append([label(now), str(now.seed), name, str(exact), where or "none", str(windows), str(states),
                         f"{mib:.1f}", f"{check['predicted_value']:.3f}", f"{check['measured_value']:.3f}",
                         f"{check['kl']:.3f}", f"{check['nll']:.2f}"])
    header = ["budget at 8,192 tokens", "data order", "a window's keys", "exact heads", "exact (layer.KV head)",
              "window heads",
              "window + state heads", "MiB held now", "value the solve predicted", "measured value",
              "KL (nats/token)", "passkey-answer nats"]
    return markdown(header, rows) if rows else ""
