"""The tokens study's blocks (studies.dof_tokens) on synthetic finished runs: each student's row at each KL
token count and held-out split, `dof` − `fix` paired where both ran, and the ratio curve with its figure."""
from __future__ import annotations

import json
import math

from dofla.report import crossed_interval, load_records, paired_interval, share_interval
from studies import records, results
from studies.dof_tokens import tokens_figure
from tests.unit.test_results_tables import SEQS, fake_run, measure

SHIFTS = {("fix", 65536): 1.2, ("dof", 65536): 1.1, ("fix", 262144): 0.8, ("dof", 262144): 0.7}


def run_with(root, name, preset, seed, shift, policy, tokens, split=None):
    """fake_run's run, its config carrying the KL tokens and the held-out split as the pipeline records them."""
    run = fake_run(root, name, preset, seed, shift, policy=policy)
    record = json.loads((run / "run.json").read_text())
    record["config"]["distill"] = {"tokens": tokens}
    record["config"]["data"] = {"heldout_split": split} if split else {}
    (run / "run.json").write_text(json.dumps(record))
    if split == "test":  # the test scoring measures generation agreement too
        first, prefix = [float(i % 3 > 0) for i in range(8)], [float((i + seed) % 5) for i in range(8)]
        measure(run, "agreement", {"agreement/first_token": 0.0, "seq/agreement/first_token": first,
                                   "seq/agreement/prefix_len": prefix})
    return run


def build(tmp_path, presets=("linear_delta_kl",)):
    """Records as the DoF page reads them: 65,536-token runs in headline/ and dof_allocation/ (dev), longer
    ones in dof_tokens/ (dev) and dof_tokens_test/ (test, shifted by the other text's 0.3 nats)."""
    for preset in presets:
        for seed in (0, 1):
            for (policy, tokens), shift in SHIFTS.items():
                name = f"{preset}_{policy}_t{tokens}_s{seed}"
                if tokens == 65536:
                    page = "headline" if policy == "fix" else "dof_allocation"
                    run_with(tmp_path / "runs" / page, name, preset, seed, shift, policy, tokens)
                    continue
                run_with(tmp_path / "runs" / "dof_tokens", name, preset, seed, shift, policy, tokens)
                run_with(tmp_path / "runs" / "dof_tokens_test", name, preset, seed, shift + 0.3, policy, tokens, "test")
    for page in ("headline", "dof_allocation", "dof_tokens", "dof_tokens_test"):
        records.main([str(tmp_path / "runs" / page), "--into", str(tmp_path / "records" / page)])
    return tmp_path / "records"


def test_each_token_count_and_split_gets_its_rows_and_its_dof_against_fix(tmp_path):
    root = build(tmp_path)
    blocks = results.PAGES["dof_tokens"](*results.sources_of("dof_tokens", root))
    table = blocks[("dof_tokens", "table")].splitlines()
    assert len(table) == 2 + 6  # 65,536 (dev) and 262,144 (dev, test), each under fix and dof
    dev = [r for r in load_records(root / "dof_tokens") if r.config["allocation"]["policy"] == "fix"]
    ppl = math.exp(sum(sum(r.sequences["heldout/student"]) for r in dev) / (2 * SEQS))
    assert any(row.startswith(f"| `linear_delta_kl` | 262,144 | dev | `fix` | 0, 1 | {ppl:.2f} |") for row in table)
    (test_dof,) = [row for row in table if row.startswith("| `linear_delta_kl` | 262,144 | test | `dof` | 0, 1 |")]
    runs = [r for r in load_records(root / "dof_tokens_test") if r.config["allocation"]["policy"] == "dof"]
    first = share_interval([r.sequences["agreement/first_token"] for r in runs])
    prefix = crossed_interval([r.sequences["agreement/prefix_len"] for r in runs])
    assert (first.hits, first.trials) == (10, 16)
    assert test_dof.endswith(f" | {first} (10/16) | {prefix.mean:.3f} ± {prefix.half_width:.3f} |")
    assert all(row.endswith(" | – | – |") for row in table[2:] if "| dev |" in row)  # not measured there
    comparisons = blocks[("dof_tokens", "comparisons")]
    dof = sorted((r for r in load_records(root / "dof_tokens_test") if r.config["allocation"]["policy"] == "dof"),
                 key=lambda r: r.seed)
    fix = sorted((r for r in load_records(root / "dof_tokens_test") if r.config["allocation"]["policy"] == "fix"),
                 key=lambda r: r.seed)
    gap = paired_interval([r.sequences["heldout/student"] for r in dof], [r.sequences["heldout/student"] for r in fix])
    assert f"| `linear_delta_kl` | 262,144 | test | `dof` − `fix`, held-out loss | 0, 1 | {gap.mean:+.3f} ± " \
           f"{gap.half_width:.3f} |" in comparisons
    assert "| 65,536 | dev | `dof` − `fix`, held-out loss | 0, 1 |" in comparisons
    for order in (0, 1):  # two orders: each alone too, its interval over the held-out text only
        alone = paired_interval([dof[order].sequences["heldout/student"]], [fix[order].sequences["heldout/student"]])
        assert f"| 262,144 | test | `dof` − `fix`, held-out loss, order {order} alone | {order} | {alone.mean:+.3f} ± " \
               f"{alone.half_width:.3f} (text only) |" in comparisons


def test_a_student_without_a_longer_run_has_no_rows(tmp_path):
    root = build(tmp_path)
    for source in ("dof_tokens", "dof_tokens_test"):
        for record in (root / source).iterdir():
            for path in record.iterdir():
                path.unlink()
            record.rmdir()
    blocks = results.PAGES["dof_tokens"](*results.sources_of("dof_tokens", root))
    assert blocks == {("dof_tokens", "table"): "", ("dof_tokens", "comparisons"): ""}
    assert results.PAGES["tokens_curve"](*results.sources_of("tokens_curve", root)) == {("tokens_curve", "table"): ""}


def test_the_curve_is_the_fix_students_dev_ratio_at_each_token_count(tmp_path):
    root = build(tmp_path, presets=("linear_delta_kl", "linear_hedgehog_kl"))
    sources = results.sources_of("tokens_curve", root)
    (table,) = results.PAGES["tokens_curve"](*sources).values()
    for tokens, page in ((65536, "headline"), (262144, "dof_tokens")):
        runs = sorted((r for r in load_records(root / page)
                       if r.experiment == "linear_delta_kl" and r.config["allocation"]["policy"] == "fix"),
                      key=lambda r: r.seed)
        gap = paired_interval([r.sequences["heldout/student"] for r in runs],
                              [r.sequences["heldout/teacher"] for r in runs])
        assert f"| `linear_delta_kl` | {tokens:,} | 0, 1 | {math.exp(gap.mean):.2f}× | " \
               f"{math.exp(gap.mean - gap.half_width):.2f}–{math.exp(gap.mean + gap.half_width):.2f}× | runs and text |" \
               in table
    assert "test" not in table and len(table.splitlines()) == 2 + 4
    figure = tokens_figure([r for source in sources for r in source], tmp_path / "curve.png")
    assert figure.is_file() and figure.read_bytes()[:4] == b"\x89PNG"
    assert tokens_figure([r for r in sources[1]], tmp_path / "none.png") is None  # one token count: no line
