"""The budget page's blocks (studies.budget) on synthetic finished runs: a row per budget and held-out split,
where each plan's bytes went, the allocated students against the uniform presets paired by data order and
sequence, the plan figure, and the allocated students on the headline frontier."""
from __future__ import annotations

import json
from types import SimpleNamespace
import math

import torch

from dofla.models.plan import StudentPlan
from dofla.report import load_records, paired_interval
from dofla.report.frontier import frontier_plot, frontier_points, frontier_series, student_label
from studies import records, results
from studies.budget import exact_heads, kind, plan_counts, plan_figure
from studies.tables import signed, values
from tests.unit.test_results_tables import SEQS, fake_run

TEACHER_MIB = 360.0
LAYERS, KV = 4, 2
OPTIONS = {"exact": 4 * 2**20, "w64+s4": 34_816, "w64+s4+delta64": 34_816 + 16_384}


def plan(share: float, seed: int) -> dict:
    """allocation.json of a budget run: more exact heads for a larger share, the rest windows or window + state."""
    exact = round(share * 20) + seed
    heads = []
    for h in range(LAYERS * KV):
        option = "exact" if h < exact else "w64+s4+delta64" if h % 2 else "w64+s4"
        heads.append({"layer": h // KV, "kv_head": h % KV, "option": option, "bytes": OPTIONS[option],
                      "plan": {"window": 0 if option == "exact" else 64}})
    used = sum(h["bytes"] for h in heads)
    menu = list(OPTIONS)
    signals = [[{"kl": 0.5 - 0.01 * h * o, "nll": 3.0 - 0.1 * o} for o in range(len(menu))] for h in range(LAYERS * KV)]
    return {"budget": {"mib": share * TEACHER_MIB, "bytes": int(share * TEACHER_MIB * 2**20), "context": 8192,
                       "given": {"mib": None, "share": share}}, "heads": heads, "plan_bytes": used,
            "menu": menu, "baseline": "w64+s4", "base_signals": signals[0][1], "signals": signals,
            "weights": {"kl": 1.0, "retrieval": 1.0}, "cost": {"seconds": 3000.0},
            "interaction": {"measured_value": 0.5, "kl": 0.4 - share, "nll": 2.0 - share},
            "calibration": {"prompt_length": 1024}, "settings": {
                "teacher": "t", "budget": {"share": share}, "repair_rounds": 0, "calibration": f"sha256:{seed}"}}


def budget_run(root, share, seed, shift, split, name=None, **changed):
    """A finished allocated run; ``changed``: the allocator's settings an ablation changed (``mib`` for a
    budget given in MiB)."""
    name = name or f"share{share}_s{seed}"
    run = fake_run(root, name, "budget_tenth", seed, shift, memory={8192: share * TEACHER_MIB * 0.9}, policy="budget")
    record = json.loads((run / "run.json").read_text())
    record["config"]["data"] = {"heldout_split": split} if split == "test" else {}
    (run / "run.json").write_text(json.dumps(record))
    allocation = plan(share, seed)
    allocation["settings"]["budget"].update(changed)
    if "mib" in changed:
        allocation["budget"].update(mib=changed["mib"], given={"mib": changed["mib"], "share": None})
    (run / "allocation.json").write_text(json.dumps(allocation))
    metrics = json.loads((run / "metrics.json").read_text())
    reused = share != 0.1  # the smaller budget solved on the menu the larger one measured
    metrics.update({"allocation/cost_s": 120.0 if reused else 3000.0 + seed, "allocation/menu_s": 3000.0 + seed,
                    "allocation/menu_reused": float(reused), "allocation/share_of_training": 1.5,
                    "allocation/plan_mib/T8192": allocation["plan_bytes"] / 2**20,
                    "passkey_nll/student/T1024": 3.0 + seed + (split == "test"), "passkey_nll/teacher/T1024": 0.5})
    (run / "metrics.json").write_text(json.dumps(metrics))
    return run


def build(tmp_path):
    for seed in (0, 1):
        for share, shift in ((0.05, 0.4), (0.1, 0.2)):
            budget_run(tmp_path / "runs" / "budget", share, seed, shift, "dev")
            budget_run(tmp_path / "runs" / "budget_test", share, seed, shift + 0.3, "test")
        fake_run(tmp_path / "runs" / "headline", f"window_sinks_kl_s{seed}", "window_sinks_kl", seed, 0.5,
                 memory={8192: 8.8})
    for page in ("budget", "budget_test", "headline"):
        records.main([str(tmp_path / "runs" / page), "--into", str(tmp_path / "records" / page)])
    return tmp_path / "records"


def test_a_plan_of_two_window_lengths_counts_each():
    heads = [{"option": o, "plan": {"window": w}} for o, w in
             (("exact", 0), ("w64+s4", 64), ("w64+s4", 64), ("w1024+s4+delta64", 1024), ("w1024+s4", 1024))]
    record = SimpleNamespace(allocation={"heads": heads})
    assert plan_counts(record) == "1 / 3 / 1 / 0; windows of 64: 2, of 1,024: 2"
    record.allocation["heads"] = heads[:3]
    assert plan_counts(record) == "1 / 2 / 0 / 0"


def test_options_are_told_apart_by_what_they_keep():
    assert [kind(o) for o in ("exact", "w64+s4", "w64+s4+delta64", "delta128")] == [
        "exact", "window", "window + state", "state"]


def test_a_row_per_budget_and_split_with_its_bytes_quality_and_cost(tmp_path):
    root = build(tmp_path)
    blocks = results.PAGES["budget"](*results.sources_of("budget", root))
    table = blocks[("budget", "students")].splitlines()
    assert len(table) == 2 + 4  # two budgets, each on test and dev
    assert [row.split(" | ")[:2] for row in table[2:]] == [
        ["| 0.05 of the teacher's (18.0 MiB)", "test"], ["| 0.05 of the teacher's (18.0 MiB)", "dev"],
        ["| 0.1 of the teacher's (36.0 MiB)", "test"], ["| 0.1 of the teacher's (36.0 MiB)", "dev"]]
    dev = [r for r in load_records(root / "budget") if r.allocation["budget"]["given"]["share"] == 0.1]
    ppl = math.exp(sum(sum(r.sequences["heldout/student"]) for r in dev) / (2 * SEQS))
    (row,) = [r for r in table if r.startswith("| 0.1 of the teacher's (36.0 MiB) | dev |")]
    cells = row.split(" | ")
    plan_mib = sum(r.allocation["plan_bytes"] for r in dev) / 2 / 2**20
    assert cells[2:6] == ["0, 1", f"{plan_mib:.1f}", f"{36.0 * 0.9:.1f}", f"{ppl:.2f}"]
    assert cells[-4:] == ["–", "–", "50", "1.50 |"]  # no agreement scored on dev; allocation minutes and share
    (small,) = [r for r in table if r.startswith("| 0.05 of the teacher's (18.0 MiB) | dev |")]
    assert small.split(" | ")[-2] == "2 (the menu's 50, measured once)"


def test_where_each_plans_bytes_went(tmp_path):
    root = build(tmp_path)
    blocks = results.PAGES["budget"](*results.sources_of("budget", root))
    rows = blocks[("budget", "heads")].splitlines()[2:]
    assert len(rows) == 4  # each budget and order once, though scored on two splits
    (row,) = [r for r in rows if r.startswith("| 0.1 of the teacher's (36.0 MiB) | 1 |")]
    # share 0.1, order 1: 3 exact heads; of the other 5, heads 3, 5, 7 keep a state and 4, 6 a window alone
    assert row.split(" | ")[2:7] == ["3 (12.0 MiB)", f"2 ({2 * 34_816 / 2**20:.1f} MiB)",
                                     f"3 ({3 * 51_200 / 2**20:.1f} MiB)", "0", "0.0, 0.1, 1.0"]
    # the allocator's check before training beside the all-baseline student's, and the trained answer nats
    base = plan(0.1, 1)["base_signals"]
    assert row.split(" | ")[7:10] == [f"{0.3:.3f} (baseline {base['kl']:.3f})", f"{1.9:.2f} (baseline {base['nll']:.2f})",
                                      "1,024"]
    assert row.split(" | ")[10] == "5.00 (test; teacher 0.50) |"  # the test record, where one was scored


def test_allocated_students_pair_with_the_uniform_presets_on_dev(tmp_path):
    root = build(tmp_path)
    test, dev, headline, *_ = results.sources_of("budget", root)
    rows = results.PAGES["budget"](test, dev, headline)[("budget", "comparisons")].splitlines()[2:]
    assert len(rows) == 2  # each budget's dev runs against window + sinks; test runs pair with nothing
    mine = sorted((r for r in dev if r.allocation["budget"]["given"]["share"] == 0.1), key=lambda r: r.seed)
    other = sorted(headline, key=lambda r: r.seed)
    want = paired_interval([r.sequences["heldout/student"] for r in mine], [r.sequences["heldout/student"] for r in other])
    (row,) = [r for r in rows if r.startswith("| 0.1 of the teacher's (36.0 MiB) − window 64 + 4 sinks (8.8 MiB) |")]
    assert row.split(" | ")[1:3] == ["0, 1", signed(want)]
    assert row.endswith(" | – |")  # passkey at 2K: neither measured it


def test_the_plan_figure_and_the_frontier_show_each_budget(tmp_path):
    root = build(tmp_path)
    records_ = [r for source in results.sources_of("budget", root) for r in source]
    assert plan_figure(records_, tmp_path / "plan.png").stat().st_size > 0
    assert plan_figure(load_records(root / "headline"), tmp_path / "none.png") is None
    labels = {student_label(r) for r in load_records(root / "budget")}
    assert labels == {"budget_tenth 18.0 MiB", "budget_tenth 36.0 MiB"}
    blocks = results.PAGES["headline"](*results.sources_of("headline", root))
    frontier = blocks[("headline", "frontier")]
    assert "| budget_tenth 18.0 MiB | 2 |" in frontier and "| budget_tenth 36.0 MiB | 2 |" in frontier
    # the figure joins the budgets as one curve, in memory order; a uniform preset stays a point of its own
    headline = [r for source in results.sources_of("headline", root) for r in source]
    series = frontier_series(frontier_points(headline))
    assert [p["name"] for p in series["budget_tenth (allocated)"]] == ["budget_tenth 18.0 MiB", "budget_tenth 36.0 MiB"]
    assert [p["name"] for p in series["window_sinks_kl"]] == ["window_sinks_kl"]
    assert frontier_plot(frontier_points(headline), tmp_path / "frontier.png").stat().st_size > 10_000


def test_a_first_order_allocation_is_set_against_the_measured_menu_of_its_settings(tmp_path):
    root = build(tmp_path)
    measured = plan(0.1, 0)
    predicted = {**measured, "settings": {**measured["settings"], "budget": {"share": 0.1, "estimator": "first_order"}},
                 "cost": {"seconds": 60.0}, "interaction": {"measured_value": 0.4},
                 "signals": [[{"kl": s["kl"] + 0.001 * (h % 3), "nll": s["nll"]} for s in row]
                             for h, row in enumerate(measured["signals"])]}
    predicted["heads"] = [{**h, "option": "w64+s4"} if i == 0 else h for i, h in enumerate(measured["heads"])]
    run = tmp_path / "runs" / "budget_alloc" / "first_order_share0.1_s0"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"config": {"experiment": "budget_tenth", "seed": 0,
                                                         "allocation": {"policy": "budget"}}}))
    (run / "allocation.json").write_text(json.dumps(predicted))
    records.main([str(run), "--allocation-only", "--into", str(root / "budget_alloc")])
    blocks = results.PAGES["budget"](*results.sources_of("budget", root))
    (row,) = blocks[("budget", "first_order")].splitlines()[2:]  # the other budget has no first-order record
    cells = row.strip("| ").split(" | ")
    assert cells[:2] == ["0.1 of the teacher's (36.0 MiB)", "0"]
    assert float(cells[2]) < 1 and cells[3] == f"{sum(0.001 * (h % 3) for h in range(LAYERS * KV)) / LAYERS / KV:.4f}"
    assert cells[4:] == ["0.000", "50.0", "1.0", f"{LAYERS * KV - 1}/{LAYERS * KV}", "0.500", "0.400"]


def test_each_ablation_pairs_with_the_allocator_and_the_allocator_with_the_preset_of_its_bytes(tmp_path):
    root = build(tmp_path)
    for seed in (0, 1):
        for split, shift in (("dev", 0.25), ("test", 0.55)):
            where = tmp_path / "runs" / ("budget_ablations" + ("_test" if split == "test" else ""))
            budget_run(where, 0.1, seed, shift, split, name=f"kl_s{seed}", retrieval_weight=0)
            budget_run(where, 0.1, seed, shift, split, name=f"random_s{seed}", solver="random")
            budget_run(where, 0.1, seed, shift, split, name=f"kl100_s{seed}", kl_weight=100)
            budget_run(where, 0.1, seed, 0.45, split, name=f"window_s{seed}", mib=8.8)
            budget_run(where, 0.1, seed, shift, split, name=f"copying_s{seed}", copy_weight=1)
            budget_run(where, 0.1, seed, 0.4, split, name=f"copying_window_s{seed}", mib=8.8, copy_weight=1)
            priced = budget_run(where, 0.1, seed, shift, split, name=f"price_s{seed}")
            allocation = json.loads((priced / "allocation.json").read_text())
            allocation["settings"]["prices"] = [4194304, 34371, 135556]  # solved at a window's current price
            (priced / "allocation.json").write_text(json.dumps(allocation))
            budget_run(where, 0.1, seed, shift, split, name=f"windows_s{seed}", windows=[64, 1024])
            copy = budget_run(where, 0.1, seed, shift, split, name=f"copy_s{seed}")
            record = json.loads((copy / "run.json").read_text())
            record["config"]["distill"] = {"copy_share": 0.25}
            (copy / "run.json").write_text(json.dumps(record))
    for page in ("budget_ablations", "budget_ablations_test"):
        records.main([str(tmp_path / "runs" / page), "--into", str(root / page)])
    sources = results.sources_of("budget", root)
    rows = results.PAGES["budget"](*sources)[("budget", "ablations")].splitlines()[2:]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names.count("0.1 of the teacher's (36.0 MiB): KL alone − the allocator") == 2  # test and dev
    assert names.count("0.1 of the teacher's (36.0 MiB): a random plan − the allocator") == 2
    assert names.count("0.1 of the teacher's (36.0 MiB): KL weight 100, retrieval weight 1 − the allocator") == 2
    assert names.count("8.8 MiB: the allocator − window 64 + 4 sinks") == 1  # the presets are dev only
    copying = "+ the teacher's copying score (weight 1)"  # at a preset's bytes an ablation pairs with the preset
    assert names.count(f"0.1 of the teacher's (36.0 MiB): {copying} − the allocator") == 2
    assert names.count(f"8.8 MiB: {copying} − window 64 + 4 sinks") == 1
    assert names.count("0.1 of the teacher's (36.0 MiB): KL text 25% copy − the allocator") == 2
    assert names.count("0.1 of the teacher's (36.0 MiB): a window priced per KV head − the allocator") == 2
    assert names.count("0.1 of the teacher's (36.0 MiB): windows of 64 and 1,024 − the allocator") == 2
    kl_dev = next(row for row in rows if "KL alone" in row and "| dev |" in row)
    allocator = [r for r in sources[1] if r.allocation["budget"]["mib"] == 36.0]
    kl = [r for r in sources[5] if "kl_s" in r.name]
    expected = signed(paired_interval(torch.tensor([r.sequences["heldout/student"] for r in kl], dtype=torch.float64),
                                      torch.tensor([r.sequences["heldout/student"] for r in allocator],
                                                   dtype=torch.float64)))
    counts = "; ".join(dict.fromkeys(plan_counts(r) for r in kl))  # the ablated plans' heads by kind
    assert all(sum(map(int, plan.split(" / "))) == LAYERS * KV for plan in counts.split("; "))
    exact = "; ".join(dict.fromkeys(exact_heads(r) for r in kl))  # and which heads they keep exact
    for r in kl:  # as many listed as the counts' exact column says
        listed = exact_heads(r)
        assert (0 if listed == "none" else len(listed.split(", "))) == int(plan_counts(r).split(" / ")[0])
    assert f"| 0, 1 | {counts} | {exact} | {expected} |" in kl_dev


def test_a_recorded_plan_trained_again_pairs_with_the_run_that_chose_it(tmp_path):
    root = build(tmp_path)
    chosen = [[{"window": 64, "sinks": 4, "state": "delta", "M": 64} if (layer + h) % 2 else {"window": "all"}
               for h in range(KV)] for layer in range(LAYERS)]
    record = root / "budget_test" / "share0.1_s0" / "allocation.json"
    allocation = json.loads(record.read_text())
    allocation["plan"] = StudentPlan.from_list(chosen).to_list()  # as an allocation writes it, every field named
    record.write_text(json.dumps(allocation))
    for seed in (0, 1):  # order 1's allocated run chose no such plan: no row
        given = tmp_path / f"plan_s{seed}.json"
        given.write_text(json.dumps(chosen))  # the same plan, its defaults left out
        run = fake_run(tmp_path / "runs" / "budget_retrained_test", f"share0.1_s{seed}", "headline_common", seed, 0.6)
        meta = json.loads((run / "run.json").read_text())
        meta["config"].update(attention={"plan": str(given)}, data={"heldout_split": "test"})
        (run / "run.json").write_text(json.dumps(meta))
    records.main([str(tmp_path / "runs" / "budget_retrained_test"), "--into", str(root / "budget_retrained_test")])
    sources = results.sources_of("budget", root)
    rows = results.PAGES["budget"](*sources)[("budget", "retrained")].splitlines()[2:]
    again = [r for r in sources[-1] if r.seed == 0]
    recorded = [r for r in sources[0] if r.name == "share0.1_s0"]
    expected = signed(paired_interval(values(again, "heldout/student"), values(recorded, "heldout/student")))
    assert len(rows) == 1 and rows[0].startswith(f"| 0.1 of the teacher's (36.0 MiB), order 0: trained again − "
                                                 f"recorded | {expected} |")
