"""Does the teacher's copying score find the heads the allocator's measurement keeps exact? (``docs/results/budget.md``)

An allocation records each KV head's copying score (``budget.copy_weight``'s signal: the attention its query
heads put on the key an induction head reads, about a calibration sequence back, summed over the group) beside
the measured gains of every option. The block sets them side by side for each allocation that solved with the
copying signal, against the allocator's own plan at the same budget and data order (solved without it):
Spearman's rank correlation (``scipy.stats.spearmanr``) between the copying score and the exact option's
measured gains over the 90 KV heads, where the allocator's exact heads rank by copying score, the heads each
plan keeps exact, and each plan's signals on the calibration text as its interaction check measured them
(before any training: the KL per token and the answer nats per passkey prompt).
"""
from __future__ import annotations

from scipy.stats import spearmanr

from dofla.report import RunRecord
from studies.tables import markdown


def _exact(allocation: dict) -> list[int]:
    return [h for h, head in enumerate(allocation["heads"]) if head["option"] == "exact"]


def _name(allocation: dict, h: int) -> str:
    head = allocation["heads"][h]
    return f"{head['layer']}.{head['kv_head']}"


def _budget(allocation: dict) -> float:
    return round(allocation["budget"]["mib"], 6)


def copying_table(with_copying: list[RunRecord], allocated: list[RunRecord], label) -> str:
    """A row per budget, data order and copy weight solved with ``copy_weight`` > 0 (``with_copying``, any record
    kind: the first found) that has the allocator's plan at its budget and data order among ``allocated``;
    ``label(record)`` names the budget."""
    plain = {}
    for r in allocated:
        a = r.allocation
        if a and a.get("signals") and a["weights"].get("copying", 0) == 0 and a.get("granularity", "head") == "head":
            plain.setdefault((_budget(a), r.seed), r)
    rows, shown = [], set()
    for r in sorted(with_copying, key=lambda r: (_budget(r.allocation), r.seed)):
        a = r.allocation
        base = plain.get((_budget(a), r.seed))
        if base is None or not a.get("copying") or not a["weights"].get("copying"):
            continue
        key = (_budget(a), r.seed, a["weights"]["copying"])  # an allocation-only record and the trained run's
        if key in shown:
            continue
        shown.add(key)
        b, scores = base.allocation, a["copying"]["heads"]
        exact = a["menu"].index("exact")
        gains = {name: [a["base_signals"][key] - s[exact][key] for s in a["signals"]]
                 for name, key in (("KL", "kl"), ("answer NLL", "nll"))}
        rank = {h: i + 1 for i, h in enumerate(sorted(range(len(scores)), key=lambda h: (-scores[h], h)))}
        top = sorted(range(len(scores)), key=lambda h: (-scores[h], h))[:6]
        rows.append([
            label(r), str(r.seed), f"{a['weights']['copying']:g}",
            "; ".join(f"{name} {spearmanr(scores, g)[0]:+.2f}" for name, g in gains.items()),
            ", ".join(f"{_name(a, h)} ({scores[h]:.2f})" for h in top),
            ", ".join(f"{_name(b, h)} (#{rank[h]})" for h in _exact(b)),
            ", ".join(_name(a, h) for h in _exact(a)),
            f"{b['interaction']['kl']:.3f} → {a['interaction']['kl']:.3f}",
            f"{b['interaction']['nll']:.2f} → {a['interaction']['nll']:.2f}"])
    header = ["budget at 8,192 tokens", "data order", "copying weight",
              "Spearman's ρ, copying score vs the exact option's gain (90 KV heads)",
              "strongest copiers (score)", "the allocator's exact heads (copying rank)",
              "exact heads with the copying signal", "calibration KL per token: allocator → with copying",
              "calibration answer nats: allocator → with copying"]
    return markdown(header, rows) if rows else ""
