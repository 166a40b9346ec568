"""How the allocator's plan moves with the weight of its two signals (``docs/results/budget.md``).

An option's value is ``kl_weight`` × its KL gain (nats per token) + ``retrieval_weight`` × its passkey-answer
NLL gain (nats per prompt). The two are in different units, so equal weights are a choice, not a neutral
point. A measured menu holds both gains of every option at every KV head, so the knapsack can be solved
again for any weights without running a model: the block does that (``dofla.dof.solve_knapsack``, the
allocator's solver) for a ladder of KL weights against a retrieval weight of 1, at the budget of the
ablations, and says what each plan keeps exact, how many heads it moves from the allocator's plan and how
much of each signal's best summed gain it keeps (summed single-head gains, as the solver sees them; a trained
ablation measures the student).
"""
from __future__ import annotations

from dofla.dof import head_values, solve_knapsack
from dofla.report import RunRecord
from studies.tables import markdown

KL_WEIGHTS = (0.0, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, None)  # None: the KL gain alone


def option_sizes(allocation: dict) -> list[int] | None:
    """Each menu option's bytes at the budget's context, read off the heads that took it (every KV head of a
    teacher costs the same for one option); None when some option was taken by no head."""
    size = {h["option"]: h["bytes"] for h in allocation["heads"]}
    return [size[o] for o in allocation["menu"]] if all(o in size for o in allocation["menu"]) else None


def summed_gains(measured: dict, options) -> tuple[float, float]:
    """The plan's summed single-head KL gain (nats per token) and answer-NLL gain (nats per prompt)."""
    base = measured["base"]
    return (sum(base["kl"] - measured["signals"][h][o]["kl"] for h, o in enumerate(options)),
            sum(base["nll"] - measured["signals"][h][o]["nll"] for h, o in enumerate(options)))


def weight_plans(allocation: dict, kl_weights=KL_WEIGHTS) -> list[dict]:
    """The optimal plan per KL weight (retrieval weight 1; None: retrieval weight 0) on a head-by-head measured
    menu: its options, exact heads ("layer.KV head"), heads unlike the record's plan and summed gains."""
    sizes = option_sizes(allocation)
    if sizes is None:
        raise ValueError("the allocation's menu has an option no head took, so its bytes are not in the record")
    measured = {"base": allocation["base_signals"], "signals": allocation["signals"]}
    kv = 1 + max(h["kv_head"] for h in allocation["heads"])
    chosen = [allocation["menu"].index(h["option"]) for h in allocation["heads"]]
    exact = allocation["menu"].index("exact") if "exact" in allocation["menu"] else None
    plans = []
    for w in kl_weights:
        kl_weight, retrieval_weight = (1.0, 0.0) if w is None else (w, 1.0)
        values = head_values(measured, kl_weight, retrieval_weight)
        choice = solve_knapsack(values, [sizes] * len(values), allocation["budget"]["bytes"])
        kl, nll = summed_gains(measured, choice.options)
        plans.append({"kl_weight": kl_weight, "retrieval_weight": retrieval_weight, "options": list(choice.options),
                      "exact": [f"{h // kv}.{h % kv}" for h, o in enumerate(choice.options) if o == exact],
                      "moved": sum(o != c for o, c in zip(choice.options, chosen)), "kl_gain": kl, "nll_gain": nll})
    return plans


def weights_table(records: list[RunRecord], mibs: set[float]) -> str:
    """A row per KL weight for each head-by-head measured allocation at a budget in ``mibs`` (rounded MiB)
    solved with the allocator's default weights, its first data order per budget."""
    found = {}
    for r in sorted(records, key=lambda r: r.seed):
        a = r.allocation
        if not (a and a.get("granularity") == "head" and a.get("signals") and "settings" in a):
            continue
        if a["settings"]["budget"].get("estimator", "measured") != "measured" or \
                (a["weights"]["kl"], a["weights"]["retrieval"], a["weights"].get("copying", 0.0)) != (1.0, 1.0, 0.0) \
                or option_sizes(a) is None:
            continue
        if round(a["budget"]["mib"], 6) in mibs:
            found.setdefault(round(a["budget"]["mib"], 6), r)
    rows = []
    for mib, r in sorted(found.items()):
        plans = weight_plans(r.allocation)
        best_kl, best_nll = max(p["kl_gain"] for p in plans), max(p["nll_gain"] for p in plans)
        given = r.allocation["budget"]["given"]
        name = f"{given['share']:g} of the teacher's" if given.get("share") else f"{given['mib']:g} MiB"
        for p in plans:
            weight = "KL alone" if p["retrieval_weight"] == 0 else f"{p['kl_weight']:g}"
            rows.append([f"{name}, order {r.seed}", weight, str(len(p["exact"])), ", ".join(p["exact"]),
                         str(p["moved"]), f"{p['kl_gain']:.4f} ({p['kl_gain'] / best_kl:.2f})",
                         f"{p['nll_gain']:.2f} ({p['nll_gain'] / best_nll:.2f})"])
    header = ["budget at 8,192 tokens", "KL weight (retrieval weight 1)", "exact KV heads",
              "which (layer.KV head)", "heads moved from the allocator's plan",
              "summed KL gain, nats/token (share of the best)", "summed answer-NLL gain, nats (share of the best)"]
    return markdown(header, rows) if rows else ""
