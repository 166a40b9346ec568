"""The budget page's copying block (studies.budget_copying) on synthetic records: an allocation solved with the
teacher's copying score against the allocator's plan of the same budget and data order: the rank correlation
with the measured gains, the strongest copiers, the allocator's exact heads ranked, and both plans' signals."""
from __future__ import annotations

import json

from scipy.stats import spearmanr

from studies import records, results
from tests.unit.test_budget_page import KV, LAYERS, build, plan


def copying_record(root, tmp_path, scores: list[float], exact: list[int], name: str = "copying_share0.1_s0"):
    """An allocation-only record at 0.1, order 0, solved with copy weight 1: ``exact`` heads kept exact."""
    allocation = plan(0.1, 0)
    allocation["heads"] = [{**h, "option": "exact" if i in exact else "w64+s4"} for i, h in enumerate(allocation["heads"])]
    allocation.update(weights={"kl": 1.0, "retrieval": 1.0, "copying": 1.0},
                      copying={"heads": scores, "scores": scores, "keeps": [True, False, False], "length": 512},
                      interaction={"measured_value": 0.7, "kl": 0.25, "nll": 1.5})
    allocation["settings"]["budget"]["copy_weight"] = 1.0
    for h, options in enumerate(allocation["signals"]):  # the exact option's gains vary by head
        options[0] = {"kl": 0.4 + 0.01 * h, "nll": 2.0 - 0.3 * scores[h]}
    run = tmp_path / "runs" / "budget_alloc" / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"config": {"experiment": "budget_tenth", "seed": 0,
                                                         "allocation": {"policy": "budget"}}}))
    (run / "allocation.json").write_text(json.dumps(allocation))
    records.main([str(run), "--allocation-only", "--into", str(root / "budget_alloc")])
    return allocation


def test_a_copying_allocation_is_set_against_the_allocators_plan_of_its_budget_and_order(tmp_path):
    root = build(tmp_path)
    scores = [0.05 * ((3 * h) % (LAYERS * KV)) for h in range(LAYERS * KV)]  # distinct, not in head order
    allocation = copying_record(root, tmp_path, scores, exact=[5, 6])
    copying_record(root, tmp_path, scores, exact=[5, 6], name="copying_again_s0")  # the same allocation twice
    blocks = results.PAGES["budget"](*results.sources_of("budget", root))
    (row,) = blocks[("budget", "copying")].splitlines()[2:]  # one budget, order and weight: one row
    cells = row.strip("| ").split(" | ")
    assert cells[:3] == ["0.1 of the teacher's (36.0 MiB)", "0", "1"]
    kl = [allocation["base_signals"]["kl"] - s[0]["kl"] for s in allocation["signals"]]
    nll = [allocation["base_signals"]["nll"] - s[0]["nll"] for s in allocation["signals"]]
    assert cells[3] == f"KL {spearmanr(scores, kl)[0]:+.2f}; answer NLL +1.00"  # the NLL gain grows with the score
    order = sorted(range(LAYERS * KV), key=lambda h: -scores[h])
    assert cells[4].split(", ")[0] == f"{order[0] // KV}.{order[0] % KV} ({scores[order[0]]:.2f})"
    assert len(cells[4].split(", ")) == 6
    # the allocator's plan at 0.1, order 0 keeps heads 0 and 1 exact (plan(): round(0.1 * 20) + 0)
    assert cells[5] == f"0.0 (#{order.index(0) + 1}), 0.1 (#{order.index(1) + 1})"
    assert cells[6] == "2.1, 3.0"
    allocator = plan(0.1, 0)["interaction"]
    assert cells[7:] == [f"{allocator['kl']:.3f} → 0.250", f"{allocator['nll']:.2f} → 1.50"]


def test_no_copying_allocation_no_rows(tmp_path):
    root = build(tmp_path)
    assert results.PAGES["budget"](*results.sources_of("budget", root))[("budget", "copying")] == ""
