"""Run records and the results pages' generated blocks, on synthetic finished runs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dofla.eval.store import MEASUREMENTS, Measurements
from dofla.report import load_records, paired_interval
from dofla.report.records import run_record
from dofla.report import paired_share_interval, share_interval
from studies import records, results

SEQS, PROMPTS = 6, 4


def fake_run(root, name, preset, seed, shift, memory=None, teacher_passkey=None, dims=None, policy="fix",
             threads=None, teacher_shift=0.0):
    """A finished run's directory as the pipeline leaves it (the files a record reads); ``memory``:
    the student's decode MiB by context, as eval.memory_contexts measures it; ``dims``: the feature
    dims per layer the allocate stage chose under ``policy``; ``threads``: run.json's thread count;
    ``teacher_shift``: added to the teacher's held-out losses."""
    run = root / name
    gen = torch.Generator().manual_seed(seed)
    text = torch.linspace(2.0, 3.0, SEQS, dtype=torch.float64)  # the same held-out text in every run
    student = (text + shift + 0.01 * seed + 0.02 * torch.rand(SEQS, generator=gen, dtype=torch.float64)).tolist()
    hits = [float((i + seed) % 2) for i in range(PROMPTS)]
    (run).mkdir(parents=True)
    config = {"experiment": preset, "seed": seed, "allocation": {"policy": policy}}
    (run / "run.json").write_text(json.dumps({"config": config, "host": "machine",
                                              **({"threads": threads} if threads else {})}))
    if dims is not None:
        (run / "allocation.json").write_text(json.dumps({"policy": policy, "dims": dims}))
    metrics = {"eval/student_loss": sum(student) / SEQS, "l": 0.0, "p": 0.0}  # every stored scalar, as the eval writes
    metrics.update({f"memory/student/decode_mib/T{context}": mib for context, mib in (memory or {}).items()})
    (run / "metrics.json").write_text(json.dumps(metrics))
    store = Measurements(run / MEASUREMENTS, main=True)
    store.get("perplexity/teacher", {}, lambda: {"l": 0.0, "seq/heldout/teacher": (text + teacher_shift).tolist()})
    store.get("perplexity/student", {}, lambda: {"l": 0.0, "seq/heldout/student": student})
    store.get("passkey/student", {}, lambda: {"p": 0.0, "seq/passkey/student/T1024": hits})
    if teacher_passkey:  # {length: hits}: the teacher's passkey prompts at those lengths
        store.get("passkey/teacher", {}, lambda: {"p": 0.0, **{f"seq/passkey/teacher/T{n}": h
                                                              for n, h in teacher_passkey.items()}})
    return run


def test_a_record_keeps_the_dof_per_layer_and_head_and_not_the_samples(tmp_path):
    run = fake_run(tmp_path / "sweep", "a_s0", "linear_delta_kl", 0, 0.5)
    dof = {"layer_dof": [3.0, 2.0], "per_head": [[4.0, 2.0], [1.0, 3.0]], "settings": {"lambda": 0.01}}
    (run / "dof.json").write_text(json.dumps({**dof, "samples": [[1.0] * 16] * 2, "warning": None}))
    fake_run(tmp_path / "sweep", "b_s0", "linear_delta_kl", 0, 0.5)  # no dof stage: no dof in its record
    records.main([str(tmp_path / "sweep"), "--into", str(tmp_path / "records")])
    with_dof, without = load_records(tmp_path / "records")
    assert with_dof.dof == dof and without.dof is None
    assert run_record(run).dof == dof  # a run directory read as its record would be


def measure(run, name: str, values: dict, settings: dict | None = None) -> None:
    """Store measurement ``name`` (its scalars and ``seq/`` lists) in ``run`` and add its scalars to
    metrics.json, as the eval stage does: a record keeps the sequences of what metrics.json holds."""
    Measurements(run / MEASUREMENTS, main=True).get(name, settings or {}, lambda: values)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.update({k: v for k, v in values.items() if not k.startswith("seq/")})
    (run / "metrics.json").write_text(json.dumps(metrics))


def test_records_keep_the_per_sequence_values_and_drop_the_host(tmp_path):
    run = fake_run(tmp_path / "sweep", "a_s0", "window_sinks_kl", 0, 0.5, dims=[96, 32])
    records.main([str(tmp_path / "sweep"), "--into", str(tmp_path / "records")])
    (record,) = load_records(tmp_path / "records")
    assert record.allocation == {"policy": "fix", "dims": [96, 32]}
    assert record.name == "a_s0" and record.experiment == "window_sinks_kl" and record.seed == 0
    assert record.sequences["heldout/teacher"] == pytest.approx(torch.linspace(2.0, 3.0, SEQS).tolist())
    assert "host" not in json.loads((tmp_path / "records" / "a_s0" / "run.json").read_text())
    assert run.is_dir()


def test_the_headline_blocks_are_recomputed_from_the_records(tmp_path):
    for seed in range(3):
        fake_run(tmp_path / "runs", f"sw_s{seed}", "window_sinks_kl", seed, 0.5)
        fake_run(tmp_path / "runs", f"hy_s{seed}", "hybrid_text", seed, 0.2)
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records" / "headline")])
    blocks = results.headline(load_records(tmp_path / "records" / "headline"))
    loaded = load_records(tmp_path / "records" / "headline")
    sw = results.values(results.arm(loaded, "window_sinks_kl"), "heldout/student")
    hy = results.values(results.arm(loaded, "hybrid_text"), "heldout/student")
    teacher = results.values(results.arm(loaded, "window_sinks_kl"), "heldout/teacher")
    delta = paired_interval(sw, teacher)
    main = blocks[("headline", "main")]
    assert f"| {math.exp(sw.mean().item()):.2f} | {math.exp(delta.mean):.2f}× | {delta.mean:+.3f} ± {delta.half_width:.3f} |" in main
    versus = paired_interval(hy, sw)
    assert f"{versus.mean:+.3f} ± {versus.half_width:.3f}" in blocks[("headline", "comparisons")]
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- results: headline main -->\nold\n<!-- /results -->\nend\n")
    text, changed = results.rewrite(page.read_text(), "headline", blocks, "headline")
    assert changed == ["headline: headline main"] and main in text and text.endswith("<!-- /results -->\nend\n")
    assert results.rewrite(text, "headline", blocks, "headline")[1] == []  # recomputed: nothing differs


def test_the_frontier_figure_is_drawn_from_the_records_that_measured_decode_memory(tmp_path):
    fake_run(tmp_path / "runs", "sw_s0", "window_sinks_kl", 0, 0.5)
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    figure = tmp_path / "figures" / "frontier.png"
    assert results.frontier_figure(load_records(tmp_path / "records"), figure) is None and not figure.exists()
    fake_run(tmp_path / "runs", "hy_s0", "hybrid_text", 0, 0.2, memory={2048: 17.6, 8192: 17.6})
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    assert results.frontier_figure(load_records(tmp_path / "records"), figure) == figure
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000


def test_a_preset_under_another_allocation_policy_is_a_point_of_its_own_on_the_frontier(tmp_path):
    for seed in range(2):
        fake_run(tmp_path / "runs", f"d_s{seed}", "linear_delta_kl", seed, 1.2, memory={8192: 4.2})
        fake_run(tmp_path / "runs", f"d_dof_s{seed}", "linear_delta_kl", seed, 1.1, memory={8192: 4.2}, policy="dof")
    fake_run(tmp_path / "runs", "d_fix_max_s0", "linear_delta_kl", 0, 1.0, memory={8192: 14.6}, policy="fix_max")
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    points = results.frontier_points(load_records(tmp_path / "records"))
    assert points[0]["name"] == "teacher" and points[-1]["name"] == "linear_delta_kl fix_max"  # by memory
    assert {p["name"]: p["runs"] for p in points[1:]} == {"linear_delta_kl": 2, "linear_delta_kl dof": 2,
                                                          "linear_delta_kl fix_max": 1}
    blocks = results.headline([r for r in load_records(tmp_path / "records") if r.config["allocation"]["policy"] == "fix"],
                              [r for r in load_records(tmp_path / "records") if r.config["allocation"]["policy"] != "fix"])
    assert "| linear_delta_kl fix_max | 1 |" in blocks[("headline", "frontier")]
    assert "fix_max" not in blocks[("headline", "main")]  # the main table holds the presets as they are


def test_the_teachers_scores_come_from_whichever_run_measured_them(tmp_path):
    """Only some presets measure passkey at 2K; the teacher's row and point show it whatever the
    records' order (here the run that measured it sorts last)."""
    fake_run(tmp_path / "runs", "a_s0", "hybrid_text", 0, 0.2, memory={2048: 17.6},
             teacher_passkey={1024: [1.0, 1.0, 1.0, 0.0]})
    fake_run(tmp_path / "runs", "z_s0", "hybrid_recall", 0, 0.0, memory={2048: 32.1, 8192: 86.1},
             teacher_passkey={1024: [1.0, 1.0, 1.0, 0.0], 2048: [1.0, 1.0, 0.0, 0.0]})
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    loaded = load_records(tmp_path / "records")
    assert [r.name for r in loaded][0] == "a_s0"
    assert results.teacher_row(loaded)[-2:] == [f"{share_interval([[1.0, 1.0, 1.0, 0.0]])} (3/4)",
                                                f"{share_interval([[1.0, 1.0, 0.0, 0.0]])} (2/4)"]
    teacher = results.frontier_points(loaded)[0]
    assert teacher["name"] == "teacher" and teacher["passkey"] == {1024: 0.75, 2048: 0.5}
    assert teacher["memory"] == {}  # the fakes measured the students' decode memory only


def test_a_comparison_pairs_the_data_orders_both_arms_ran(tmp_path):
    for seed in range(2):
        fake_run(tmp_path / "runs", f"sw_s{seed}", "window_sinks_kl", seed, 0.5)
    fake_run(tmp_path / "runs", "rc_s0", "hybrid_recall", 0, 0.0)
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    loaded = load_records(tmp_path / "records")
    order0 = [r for r in results.arm(loaded, "window_sinks_kl") if r.seed == 0]
    expected = paired_interval(results.values(results.arm(loaded, "hybrid_recall"), "heldout/student"),
                               results.values(order0, "heldout/student"))
    row = f"| recall hybrid − window + sinks, held-out loss | 0 | {expected.mean:+.3f} ± {expected.half_width:.3f} (text only) |"
    assert row in results.headline(loaded)[("headline", "comparisons")]


@pytest.mark.parametrize("shift, refused", [(1.0, True), (1e-4, False)])
def test_runs_scored_on_different_text_are_refused(tmp_path, shift, refused):
    """Another sequence moves the teacher's loss by tenths of a nat and is refused; the same sequence
    scored with fp32 sums in another order moves it by about 1e-4 and is paired as it is."""
    fake_run(tmp_path / "runs", "a", "window_sinks_kl", 0, 0.5)
    other = fake_run(tmp_path / "runs", "b", "window_sinks_kl", 1, 0.5)
    sequences = json.loads((other / "eval_sequences.json").read_text())
    for entry in sequences.values():
        if "seq/heldout/teacher" in entry:
            entry["seq/heldout/teacher"][0] += shift
    (other / "eval_sequences.json").write_text(json.dumps(sequences))
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "records")])
    if refused:
        with pytest.raises(SystemExit, match="different heldout/teacher text"):
            results.headline(load_records(tmp_path / "records"))
    else:
        assert "window_sinks_kl" in results.headline(load_records(tmp_path / "records"))[("headline", "main")]


def test_the_dof_page_pairs_each_policy_with_fix_by_data_order_and_reads_the_headline_records(tmp_path):
    """`fix` is the headline preset's run (its records stay with the headline's); `dof` is paired with it
    by data order and sequence, pooled and per order, and the allocation's dims reach the table."""
    for seed in range(3):
        fake_run(tmp_path / "headline", f"fix_s{seed}", "linear_hedgehog_kl", seed, 1.0, dims=[64, 64, 64])
        fake_run(tmp_path / "dof", f"dof_s{seed}", "linear_hedgehog_kl", seed, 1.1, dims=[150 + seed, 30, 12], policy="dof")
    fake_run(tmp_path / "headline", "sw_s0", "window_sinks_kl", 0, 0.5)  # another preset: not an arm
    fake_run(tmp_path / "headline", "delta_s0", "linear_delta_kl", 0, 0.9, dims=[64, 64, 64])
    for source, page in (("headline", "headline"), ("dof", "dof_allocation")):
        records.main([str(tmp_path / source), "--into", str(tmp_path / "records" / page)])
    sources = [load_records(tmp_path / "records" / page) for page in results.SOURCES["dof_allocation"][:2]]
    blocks = results.PAGES["dof_allocation"](*sources, [])
    loaded = sources[0] + sources[1]
    main, comparisons = blocks[("dof_allocation", "main")], blocks[("dof_allocation", "comparisons")]
    assert "linear_delta_kl" not in main + comparisons and blocks[("dof_allocation", "algorithm1")] == ""
    assert "| `fix` | `experiment=linear_delta_kl` | 1 |" in blocks[("dof_allocation", "delta_main")]
    assert blocks[("dof_allocation", "delta_comparisons")] == ""  # no other policy ran on the delta student
    assert "| `fix` | `experiment=linear_hedgehog_kl` | 3 |" in main and "| 64 | 64 |" in main
    assert "`allocation=dof` | 3 |" in main and "| 150–152 | 12–30 |" in main and "window" not in main
    dof = [r for r in loaded if r.name.startswith("dof")]
    fix = [r for r in loaded if r.name.startswith("fix")]
    pooled = paired_interval(results.values(dof, "heldout/student"), results.values(fix, "heldout/student"))
    assert pooled.counts == "runs and text"
    assert f"| `dof` − `fix`, held-out loss | 0, 1, 2 | {pooled.mean:+.3f} ± {pooled.half_width:.3f} |" in comparisons
    one = paired_interval(results.values(dof[2:], "heldout/student"), results.values(fix[2:], "heldout/student"))
    assert f"order 2 alone | 2 | {one.mean:+.3f} ± {one.half_width:.3f} (text only) |" in comparisons


def test_the_papers_algorithm1_is_kept_as_its_allocation_beside_the_projects_estimate(tmp_path):
    """A run stopped after the allocate stage keeps run.json and allocation.json; the page's Algorithm 1
    table shows its settings and result next to the project's estimate of the same data order."""
    fake_run(tmp_path / "dof", "dof_s0", "linear_delta_kl", 0, 1.1, dims=[150, 30, 12], policy="dof")
    (tmp_path / "dof" / "dof_s0" / "allocation.json").write_text(json.dumps(
        {"policy": "dof", "dims": [150, 30, 12], "layer_dof": [15.0, 3.0, 1.2], "gram_norm": "trace", "lambda": 0.01}))
    paper = tmp_path / "paper_s0"
    paper.mkdir()
    config = {"experiment": "linear_delta_kl", "seed": 0, "stages": ["cache", "allocate"],
              "allocation": {"policy": "dof", "gram_norm": "J", "lam": 0.0625, "num_samples": 2048, "resamples": 1,
                             "head_aggregate": "max"}}
    (paper / "run.json").write_text(json.dumps({"config": config, "host": "machine"}))
    (paper / "allocation.json").write_text(json.dumps(
        {"policy": "dof", "dims": [59, 64, 65], "layer_dof": [1888.5, 2040.0, 2048.0], "gram_norm": "J", "lambda": 0.0625}))
    with pytest.raises(SystemExit, match="no finished run"):  # it measured nothing: not a finished run
        records.main([str(paper), "--into", str(tmp_path / "records" / "algorithm1")])
    records.main([str(paper), "--allocation-only", "--into", str(tmp_path / "records" / "algorithm1")])
    records.main([str(tmp_path / "dof"), "--into", str(tmp_path / "records" / "dof_allocation")])
    (kept,) = load_records(tmp_path / "records" / "algorithm1")
    assert kept.metrics == {} and kept.sequences == {} and kept.allocation["dims"] == [59, 64, 65]
    assert sorted(p.name for p in (tmp_path / "records" / "algorithm1" / "paper_s0").iterdir()) == ["allocation.json", "run.json"]
    table = results.PAGES["dof_allocation"](load_records(tmp_path / "records" / "dof_allocation"), [], [kept])
    rows = table[("dof_allocation", "algorithm1")].splitlines()[2:]
    assert rows == ["| the project's variant (`allocation=dof`) | 0 | `trace` | 0.01 | – | – | `–` | 15.0 | 1.2–3.0 | 150 | 12–30 |",
                    "| the paper's form | 0 | `J` | 0.0625 | 2048 | 1 | `max` | 1888.5 | 2040.0–2048.0 | 59 | 64–65 |"]


def test_the_mqar_block_gives_each_students_share_and_pairs_the_two_forms_by_example(tmp_path):
    teacher = [1.0, 1.0, 0.75, 1.0]
    shares = {"linear_delta_kl": [0.5, 0.25, 0.25, 0.0], "linear_hedgehog_kl": [0.0, 0.25, 0.0, 0.0]}
    for preset, hits in shares.items():
        run = fake_run(tmp_path / "runs", f"{preset}_mqar_s0", preset, 0, 1.0)
        measure(run, "mqar", {"m": 0.0, "seq/mqar/teacher/T64": teacher, "seq/mqar/student/T64": hits})
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "mqar")])
    table = results.PAGES["mqar"](load_records(tmp_path / "mqar"))[("headline", "table")].splitlines()
    assert table[0] == "| student | runs | held-out ppl | T = 64 (16 pairs) |"
    loaded = load_records(tmp_path / "mqar")
    ppl = {r.experiment: f"{math.exp(sum(r.sequences['heldout/student']) / SEQS):.2f}" for r in loaded}
    teacher_ppl = f"{math.exp(sum(loaded[0].sequences['heldout/teacher']) / SEQS):.2f}"
    assert table[2] == f"| {results.TEACHER} | – | {teacher_ppl} | {share_interval([teacher], per_value=16)} (60/64) |"
    delta = torch.tensor([shares["linear_delta_kl"]], dtype=torch.float64)
    additive = torch.tensor([shares["linear_hedgehog_kl"]], dtype=torch.float64)
    assert table[3] == (f"| pure linear: gated delta rule | 1 | {ppl['linear_delta_kl']} | "
                        f"{share_interval(delta, per_value=16)} (16/64) |")
    # both recall some of example 2's 16 queries: which ones is not recorded, so the pairs are per example
    versus = paired_interval(delta, additive)
    assert table[5] == (f"| gated delta − additive (paired) | 0 | – | {versus.mean:+.3f} ± {versus.half_width:.3f} (text only)"
                        " (per example) |")
    measure(tmp_path / "runs" / "linear_hedgehog_kl_mqar_s0", "mqar",  # evaluated again: what metrics.json holds
            {"m": 1.0, "seq/mqar/teacher/T64": teacher, "seq/mqar/student/T64": [0.0] * 4}, {"again": 1})
    records.main([str(tmp_path / "runs"), "--into", str(tmp_path / "mqar_again")])
    table = results.PAGES["mqar"](load_records(tmp_path / "mqar_again"))[("headline", "table")].splitlines()
    known = paired_share_interval(delta, torch.zeros(1, 4, dtype=torch.float64), per_value=16)
    assert (known.only_a, known.only_b) == (16, 0)  # the additive student recalls none: every pair is known
    assert table[5] == f"| gated delta − additive (paired) | 0 | – | {known} (McNemar p = {known.p_value:.2g}) |"
    assert results.PAGES["mqar"]([]) == {("headline", "table"): ""}


@pytest.mark.parametrize("page", sorted(results.PAGES))
def test_the_committed_pages_are_what_the_committed_records_give(page):
    """README's and each results page's generated blocks equal what studies.results builds from the
    committed records (empty while none is committed): no number in them is typed by hand."""
    assert results.run(page, check=True) == []
    if page != "headline":
        return
    if any("memory/student/decode_mib/T2048" in r.metrics for r in load_records(results.RECORDS / "headline")):
        assert results.FIGURES["headline"][0].is_file()  # README and the page show it


def test_the_rerun_check_pairs_each_rerun_with_the_record_of_its_preset_and_order(tmp_path):
    for seed in range(2):
        fake_run(tmp_path / "headline", f"sw_s{seed}", "window_sinks_kl", seed, 0.5)
    fake_run(tmp_path / "rerun", "sw_s1", "window_sinks_kl", 1, 0.5 + 1e-3)  # the same run, 0.001 nats off
    fake_run(tmp_path / "rerun", "hy_s0", "hybrid_text", 0, 0.2)  # nothing recorded to compare with: no row
    for source, page in (("headline", "headline"), ("rerun", "headline_rerun")):
        records.main([str(tmp_path / source), "--into", str(tmp_path / "records" / page)])
    sources = [load_records(tmp_path / "records" / page) for page in results.SOURCES["headline_rerun"]]
    (table,) = results.PAGES["headline_rerun"](*sources).values()
    recorded = math.exp(sum(sources[1][1].sequences["heldout/student"]) / SEQS)
    assert f"| `window_sinks_kl` | 1 | {recorded:.2f} | {recorded * math.exp(1e-3):.2f} | +0.0010 | 0.0010 |" in table
    assert "hybrid_text" not in table and "| 0 |" not in table


def test_the_threads_check_pairs_each_run_with_the_fewest_threads_run_of_its_config_and_order(tmp_path):
    fake_run(tmp_path / "threads", "t1_s0", None, 0, 0.5, threads=1)
    fake_run(tmp_path / "threads", "t2_s0", None, 0, 0.5 + 2e-3, threads=2, teacher_shift=1e-4)
    fake_run(tmp_path / "threads", "t2_s1", None, 1, 0.5, threads=2)  # alone in its order: no row
    fake_run(tmp_path / "threads", "x_s0", None, 0, 0.9)  # no thread count on record: not compared
    records.main([str(tmp_path / "threads"), "--into", str(tmp_path / "records")])
    found = load_records(tmp_path / "records")
    assert [r.threads for r in found] == [1, 2, 2, None]
    (table,) = results.PAGES["threads"](found).values()
    fewer = math.exp(sum(found[0].sequences["heldout/student"]) / SEQS)
    assert f"| `default` | 0 | 1 → 2 | {fewer:.2f} | {fewer * math.exp(2e-3):.2f} | +0.0020 | 0.0020 | 0.0001 |" in table
    assert table.count("\n| `default`") == 1


def test_every_committed_records_sequences_are_those_of_its_metrics():
    """Each committed record's per-sequence held-out losses and position buckets average to the scalars its
    metrics.json holds: the sequences come from the scoring the metrics are (not an earlier one)."""
    checked = 0
    for root in sorted(p for p in results.RECORDS.iterdir() if p.is_dir()):
        for record in load_records(root):
            for name, values in record.sequences.items():
                scalar = record.metrics.get(f"eval/{name.split('/')[1]}_loss" if name.startswith("heldout/") else name)
                if (name.startswith("heldout/") or name.startswith("position/")) and scalar is not None:
                    assert sum(values) / len(values) == pytest.approx(scalar, abs=1e-3), (record.name, name)
                    checked += 1
    assert checked > 100
