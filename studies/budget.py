"""The memory budget's generated blocks (``docs/results/budget.md``): ``python -m studies.results budget``.

The runs of ``studies/reproduce/budget.sh`` turn a share of the teacher's KV cache at 8,192 tokens into a
plan per KV head (``allocation=budget``), train it and score it on test (``docs/results/runs/budget_test/``)
and on dev (``budget/``). Their rows say what the budget bought, their plans where it went; the dev rows
are paired with the uniform presets of the headline page (scored on dev) by data order and held-out
sequence or passkey prompt.
"""
from __future__ import annotations

from collections import Counter
import math
from pathlib import Path

from dofla.dof import first_order_check
from dofla.report import RunRecord
from studies.budget_dof import dof_table
from studies.budget_copying import copying_table
from studies.budget_sizing import sizing_dof_table, sizing_table
from studies.budget_needles import needles_table
from studies.budget_retrained import recorded_runs, retrained_table
from studies.budget_weights import weights_table
from studies.dof_tokens import agreement, split
from studies.tables import KINDS, SIGNALS, arm, common_orders, kind, markdown, paired, passkey, quality, signed
from studies.window_memory import window_memory_table, window_price_table

CONTEXT = 8192
UNIFORM = (  # the headline's uniform students the allocated ones are set against (dev records)
    ("window 64 + 4 sinks", "window_sinks_kl"),
    ("hybrid: window + sinks + gated delta", "hybrid_delta"),
    ("hybrid: window + sinks + gated Hedgehog", "hybrid_text"),
    ("recall hybrid: + 6 exact copying layers", "hybrid_recall"),
)


def budget_mib(record: RunRecord) -> float:
    return record.allocation["budget"]["mib"]


def budget_name(record: RunRecord) -> str:
    """The budget as given (a share of the teacher's KV cache, or MiB) and its MiB at the context."""
    b = record.allocation["budget"]
    if not b["given"].get("share"):
        return f"{b['given']['mib']:g} MiB"
    return f"{b['given']['share']:g} of the teacher's ({b['mib']:.1f} MiB)"


def groups(records: list[RunRecord]) -> dict[tuple[float, str], list[RunRecord]]:
    """The allocated students' finished runs by (budget MiB, split), each group by data order."""
    found = {}
    for r in records:
        if r.allocation and "heads" in r.allocation and "heldout/student" in r.sequences:
            found.setdefault((round(budget_mib(r), 6), split(r)), []).append(r)
    return {k: sorted(found[k], key=lambda r: r.seed) for k in sorted(found, key=lambda k: (k[0], k[1] != "test"))}


def mean_metric(runs: list[RunRecord], name: str) -> float | None:
    """The mean of a metric over ``runs``; None without runs or where one of them lacks it."""
    got = [r.metrics[name] for r in runs if name in r.metrics]
    return sum(got) / len(got) if got and len(got) == len(runs) else None


def cell(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def students_table(found: dict) -> str:
    """A row per budget and split: the bytes (the budget, the plan's, the decode cache measured at 8,192
    tokens), the quality (95 % over runs and held-out text; shares with Wilson's interval), the
    generation-scored agreement where measured (test) and the allocation's cost beside the training's."""
    rows = []
    for (mib, part), runs in found.items():
        ppl, delta, far = quality(runs)
        cost, menu = mean_metric(runs, "allocation/cost_s"), mean_metric(runs, "allocation/menu_s")
        spent = cell(None if cost is None else cost / 60, ".0f")
        if mean_metric(runs, "allocation/menu_reused"):  # solved on another budget's measured menu
            spent += f" (the menu's {menu / 60:.0f}, measured once)"
        rows.append([budget_name(runs[0]), part, ", ".join(str(r.seed) for r in runs),
                     cell(mean_metric(runs, f"allocation/plan_mib/T{CONTEXT}"), ".1f"),
                     cell(mean_metric(runs, f"memory/student/decode_mib/T{CONTEXT}"), ".1f"),
                     f"{ppl:.2f}", f"{math.exp(delta.mean):.2f}×", signed(delta), far, passkey(runs, 1024),
                     passkey(runs, 2048), *agreement(runs), spent,
                     cell(mean_metric(runs, "allocation/share_of_training"), ".2f")])
    header = ["budget at 8,192 tokens", "held-out split", "data orders", "plan MiB", "decode MiB measured",
              "held-out ppl", "× teacher", "loss − teacher (nats)", "at positions 1,024–2,047", "passkey @ 1K",
              "passkey @ 2K", "first generated token = teacher's", "greedy tokens matched (of 32)",
              "allocation (min)", "allocation ÷ training"]
    return markdown(header, rows) if rows else ""


def before_training(record: RunRecord) -> tuple[str, str]:
    """The plan's two signals as the allocator's interaction check measured them before any training (KL per
    token on the calibration sequences, mean answer nats per calibration passkey prompt), each beside the
    all-baseline student's."""
    a = record.allocation
    if not {"kl", "nll"} <= set(a.get("interaction", {})) or "base_signals" not in a:
        return "–", "–"
    plan, base = a["interaction"], a["base_signals"]
    return f"{plan['kl']:.3f} (baseline {base['kl']:.3f})", f"{plan['nll']:.2f} (baseline {base['nll']:.2f})"


def heads_table(found: dict) -> str:
    """Where each run's budget went: how many KV heads took each kind of option and the MiB they hold at
    8,192 tokens, and which heads stayed exact (layer.KV head); then what the plan measured before training
    (the allocator's check) and the trained student's answer nats on the 1,024-token passkey prompts (its
    first split's record: test where scored)."""
    rows, seen = [], set()
    for (mib, _), runs in found.items():
        for r in runs:
            if (mib, r.seed) in seen:  # a run scored on both splits has one plan
                continue
            seen.add((mib, r.seed))
            heads = r.allocation["heads"]
            cells = []
            for k in KINDS:
                mine = [h for h in heads if kind(h["option"]) == k]
                cells.append(f"{len(mine)} ({sum(h['bytes'] for h in mine) / 2**20:.1f} MiB)" if mine else "0")
            exact = exact_heads(r)
            trained, teacher = (r.metrics.get(f"passkey_nll/{who}/T1024") for who in ("student", "teacher"))
            length = r.allocation.get("calibration", {}).get("prompt_length")
            rows.append([budget_name(r), str(r.seed), *cells, exact, *before_training(r),
                         "–" if length is None else f"{length:,}",
                         "–" if trained is None else f"{trained:.2f} ({split(r)}" +
                         ("" if teacher is None else f"; teacher {teacher:.2f}") + ")"])
    header = ["budget at 8,192 tokens", "data order", *[f"{k} heads" for k in KINDS], "exact heads (layer.KV head)",
              "before training: KL (nats/token)", "before training: passkey-answer nats per prompt",
              "calibration prompt tokens", "trained: passkey-answer nats per 1,024-token prompt"]
    return markdown(header, rows) if rows else ""


def comparisons(found: dict, headline: list[RunRecord]) -> str:
    """Each allocated student (dev) against each uniform preset (dev), paired by data order and by sequence
    or prompt: held-out loss, far-context loss, passkey at 1K and 2K (– where either did not measure it)."""
    rows = []
    for (mib, part), runs in found.items():
        if part != "dev":
            continue
        for label, preset in UNIFORM:
            other = arm(headline, preset)
            orders = common_orders(runs, other)
            if not orders:
                continue
            memory = cell(mean_metric(other, f"memory/student/decode_mib/T{CONTEXT}"), ".1f")
            rows.append([f"{budget_name(runs[0])} − {label} ({memory} MiB)", ", ".join(map(str, orders)),
                         *[paired(runs, other, name) for _, name in SIGNALS]])
    header = ["comparison (decode MiB at 8,192 tokens)", "data orders", *[what for what, _ in SIGNALS]]
    return markdown(header, rows) if rows else ""


def ablation(record: RunRecord) -> str:
    """What an ablation run changed from the allocator's defaults (its allocation settings say) or from the
    preset's training (copy text in the KL stage's text, as the recall hybrid trains), or solved at a window's
    current price (its settings carry the menu's prices: a window holds each KV head's keys once)."""
    settings, copy = record.allocation["settings"], record.config.get("distill", {}).get("copy_share", 0)
    b = settings["budget"]
    kl, retrieval = b.get("kl_weight", 1), b.get("retrieval_weight", 1)
    changed = [what for what, hit in (("per layer (a layer's KV heads alike)", b.get("granularity") == "layer"),
                                      ("a random plan", b.get("solver") == "random"),
                                      ("the retrieval signal alone", kl == 0),
                                      ("KL alone", retrieval == 0),
                                      (f"KL weight {kl:g}, retrieval weight {retrieval:g}",
                                       0 not in (kl, retrieval) and (kl, retrieval) != (1, 1)),
                                      (f"+ the teacher's copying score (weight {b.get('copy_weight', 0):g})",
                                       bool(b.get("copy_weight", 0))),
                                      (f"KL text {copy:.0%} copy", bool(copy)),
                                      ("a window priced per KV head", "prices" in settings),
                                      ("windows of " + " and ".join(f"{w:,}" for w in b.get("windows", [64])),
                                       b.get("windows", [64]) != [64])) if hit]
    return ", ".join(changed) or "the allocator"


def ablations(found: dict, runs_by_split: dict[str, list[RunRecord]], headline: list[RunRecord]) -> str:
    """Each ablation run against the allocated student of the same budget, split and data order (paired by
    sequence or prompt); at a uniform preset's decode bytes (dev) the unchanged allocator, and every ablation,
    against that preset."""
    rows = []
    for part, runs in runs_by_split.items():
        for mib in sorted({round(budget_mib(r), 6) for r in runs}):
            at = [r for r in runs if round(budget_mib(r), 6) == mib]
            preset = at_bytes(mib, headline) if part == "dev" else None
            for name in sorted({ablation(r) for r in at}):
                mine = [r for r in at if ablation(r) == name]
                pairs = [(f"{name} − the allocator", found[(mib, part)])] \
                    if name != "the allocator" and (mib, part) in found else []
                if preset:
                    pairs.append((f"{name} − {preset[0]}", arm(headline, preset[1])))
                for label, other in pairs:
                    rows.append([
                        f"{budget_name(mine[0])}: {label}", part, ", ".join(map(str, common_orders(mine, other))),
                        "; ".join(dict.fromkeys(plan_counts(r) for r in mine)),
                        "; ".join(dict.fromkeys(exact_heads(r) for r in mine)),
                        *[paired(mine, other, signal) for _, signal in SIGNALS]])
    header = ["ablation (A − B)", "held-out split", "data orders", "A's heads: " + " / ".join(KINDS),
              "A's exact heads (layer.KV head)",
              *[what for what, _ in SIGNALS]]
    return markdown(header, rows) if rows else ""


def plan_counts(record: RunRecord) -> str:
    """How many KV heads of a run's plan took each kind of option, in ``KINDS`` order ("6 / 0 / 38 / 46"), and
    where its windows are of more than one length, how many of each ("; windows of 64: 60, of 1,024: 24")."""
    heads = record.allocation["heads"]
    counts = " / ".join(str(sum(kind(h["option"]) == k for h in heads)) for k in KINDS)
    lengths = Counter(h["plan"]["window"] for h in heads if kind(h["option"]) in ("window", "window + state"))
    if len(lengths) < 2:
        return counts
    return counts + "; windows of " + ", of ".join(f"{w:,}: {n}" for w, n in sorted(lengths.items()))


def exact_heads(record: RunRecord) -> str:
    """The KV heads a run's plan keeps exact, as layer.KV head ("4.0, 18.2"), or "none"."""
    exact = [f"{h['layer']}.{h['kv_head']}" for h in record.allocation["heads"] if kind(h["option"]) == "exact"]
    return ", ".join(exact) or "none"


def at_bytes(mib: float, headline: list[RunRecord]) -> tuple[str, str] | None:
    """The uniform preset whose measured decode memory at 8,192 tokens is ``mib`` (to 0.1 MiB), if any."""
    for label, preset in UNIFORM:
        memory = mean_metric(arm(headline, preset), f"memory/student/decode_mib/T{CONTEXT}")
        if memory is not None and abs(memory - mib) < 0.05:
            return label, preset
    return None


def estimator(record: RunRecord) -> str:
    return record.allocation["settings"]["budget"].get("estimator", "measured")


def _settings_but_estimator(record: RunRecord) -> str:
    settings = dict(record.allocation["settings"])
    settings["budget"] = {k: v for k, v in settings["budget"].items() if k != "estimator"}
    return repr(sorted((k, repr(v)) for k, v in settings.items()))


def first_order_table(records: list[RunRecord]) -> str:
    """Each first-order allocation (``budget.estimator=first_order``) against the measured allocation of the same
    teacher, budget, menu and calibration: how well its values rank the measured ones (Spearman), each signal's
    mean absolute error, both costs, the heads that chose alike, and each chosen plan's value as measured by
    its interaction check (the same quantity for both plans, so the higher is the better plan)."""
    allocated = [r for r in records if r.allocation and r.allocation.get("signals") and "settings" in r.allocation]
    measured = {}
    for r in allocated:
        if estimator(r) == "measured":
            measured.setdefault(_settings_but_estimator(r), r)
    rows = []
    for predicted in sorted((r for r in allocated if estimator(r) == "first_order"), key=lambda r: (budget_mib(r), r.seed)):
        match = measured.get(_settings_but_estimator(predicted))
        if match is None:
            continue
        a, m = predicted.allocation, match.allocation
        weights = (m["weights"]["kl"], m["weights"]["retrieval"])
        got = first_order_check({"base": a["base_signals"], "signals": a["signals"]},
                                {"base": m["base_signals"], "signals": m["signals"]}, m["menu"].index(m["baseline"]), weights)
        same = sum(x["option"] == y["option"] for x, y in zip(a["heads"], m["heads"]))
        rows.append([budget_name(predicted), str(predicted.seed), f"{got['spearman']:.2f}", f"{got['kl_abs_error']:.4f}",
                     f"{got['nll_abs_error']:.3f}", f"{m['cost']['seconds'] / 60:.1f}", f"{a['cost']['seconds'] / 60:.1f}",
                     f"{same}/{len(m['heads'])}", f"{m['interaction']['measured_value']:.3f}",
                     f"{a['interaction']['measured_value']:.3f}"])
    header = ["budget at 8,192 tokens", "data order", "Spearman's ρ of the values", "KL error (nats/token)",
              "answer-NLL error (nats)", "measured menu (min)", "first order (min)", "heads alike",
              "measured plan's value", "first-order plan's value"]
    return markdown(header, rows) if rows else ""


def budget(test: list[RunRecord], dev: list[RunRecord], headline: list[RunRecord],
           allocations: list[RunRecord] = (), ablations_test: list[RunRecord] = (),
           ablations_dev: list[RunRecord] = (), dof_runs: list[RunRecord] = (),
           retrained: list[RunRecord] = ()) -> dict[tuple[str, str], str]:
    """The budget page's blocks (``allocations``: allocation-only records, e.g. a first-order allocation;
    ``ablations_*``: the ablation runs of ``studies/reproduce/budget_ablations.sh`` by split; ``dof_runs``:
    runs whose dof stage ran, their per-head DoF set against the measured menu; ``retrained``: recorded plans
    trained again, ``studies/reproduce/budget_retrain.sh``)."""
    found = groups([*test, *dev])
    return {("budget", "students"): students_table(found), ("budget", "heads"): heads_table(found),
            ("budget", "comparisons"): comparisons(found, headline),
            ("budget", "first_order"): first_order_table([*test, *allocations]),
            ("budget", "ablations"): ablations(found, {"test": list(ablations_test), "dev": list(ablations_dev)},
                                               headline),
            ("budget", "dof"): dof_table([*test, *dev], list(dof_runs)),
            ("budget", "window_memory"): window_memory_table([*arm(headline, "window_sinks_kl"), *test]),
            ("budget", "window_price"): window_price_table(list(allocations), [*test, *dev], budget_name),
            ("budget", "weights"): weights_table(list(test), {round(budget_mib(r), 6) for r in ablations_test}),
            ("budget", "copying"): copying_table([*allocations, *ablations_test, *ablations_dev], [*test, *dev],
                                                 budget_name),
            ("budget", "retrained"): retrained_table(list(retrained), list(test), budget_name),
            ("budget", "sizing"): sizing_table(list(allocations), budget_name),
            ("budget", "sizing_dof"): sizing_dof_table(list(allocations), budget_name),
            ("budget", "needles"): needles_table(
                [(f"{budget_name(r)}, order {r.seed}", r) for (_, part), runs in found.items() if part == "test"
                 for r in runs] +
                [(f"{budget_name(r)}: {ablation(r)}, order {r.seed}", r) for r in ablations_test] +
                [(f"{budget_name(recorded)}: the plan trained again, order {r.seed}", r) for r in retrained
                 for recorded in recorded_runs(r, list(test))])}


def plan_figure(records: list[RunRecord], path: Path) -> Path | None:
    """Each budget's plan (its first data order) as a grid of layers × KV heads coloured by what the head
    keeps; None while no allocated run is recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plans = {}
    for (mib, _), runs in groups(records).items():
        plans.setdefault(mib, runs[0])
    if not plans:
        return None
    colours = ["#d62728", "#9ecae1", "#2ca02c", "#ff7f0e"]
    fig, axes = plt.subplots(len(plans), 1, figsize=(9, 1.1 + 0.9 * len(plans)), squeeze=False)
    for ax, (mib, r) in zip(axes[:, 0], sorted(plans.items())):
        heads = r.allocation["heads"]
        layers, kv = 1 + max(h["layer"] for h in heads), 1 + max(h["kv_head"] for h in heads)
        grid = [[0] * layers for _ in range(kv)]
        for h in heads:
            grid[h["kv_head"]][h["layer"]] = KINDS.index(kind(h["option"]))
        ax.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=len(KINDS) - 1, aspect="auto")
        ax.set_yticks(range(kv))
        ax.set_ylabel("KV head")
        ax.set_title(f"{budget_name(r)}, data order {r.seed}", fontsize=9)
        ax.set_xticks(range(0, layers, 2))
    axes[-1, 0].set_xlabel("layer")
    fig.legend(handles=[Patch(color=c, label=k) for c, k in zip(colours, KINDS)], loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
