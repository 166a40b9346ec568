"""report: a sweep directory of runs -> report.md, report.csv, plots, and record differences."""
from __future__ import annotations

import csv
import math
import random

import pytest

from dofla.record import read_json, write_json
from dofla.report import write_report
from dofla.report.stats import gap_closed as gap_share
from dofla.report.seeds import paired_vs_fix, seed_groups
from dofla.report.stats import mean_ci, paired_differences, t_quantile
from dofla.report.tables import distinguishing_overrides, gap_closed, load_run, record_differences_within_seeds

# Published two-sided 95 % Student-t critical values t(0.975, df) (any statistics table).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 10: 2.228, 20: 2.086, 30: 2.042}


def _fake_run(path, policy, ppl, sha, dims, acc=0.4, seed=None, cache_key="abc"):
    config = {"allocation": {"policy": policy, "lam": 0.01}, "model": {"source": "tiny"}, "cache_dir": str(path),
              "seed": seed or 0}
    overrides = [f"allocation={policy}", "model=tiny_llama"] + ([f"seed={seed}"] if seed is not None else [])
    write_json(path / "run.json", {"config": config, "overrides": overrides, "seed": seed or 0,
                                   "git": {"sha": sha, "dirty": False}, "packages": {"torch": "2.13"},
                                   "device": "cpu", "cache_key": cache_key})
    write_json(path / "allocation.json", {"policy": policy, "dims": dims, "budget": 16})
    write_json(path / "dof.json", {"per_head": [[3.0, 4.0], [5.0, 1.0]], "layer_dof": [4.0, 5.0]})
    write_json(path / "metrics.json", {"eval/teacher_ppl": 10.0, "eval/student_ppl": ppl,
                                       "eval/attn_error/layer_00": 0.5, "eval/attn_error/layer_01": 0.4,
                                       "tasks/teacher/piqa/acc": 0.6, "tasks/student/piqa/acc": acc,
                                       "tasks/teacher/avg_acc": 0.6, "tasks/student/avg_acc": acc,
                                       "mqar/teacher/T64": 0.9, "mqar/teacher/T128": 0.8,
                                       "mqar/student/T64": acc, "mqar/student/T128": acc / 2})


def test_sweep_report_compares_runs_and_flags_code_differences(tmp_path):
    _fake_run(tmp_path / "0", "fix", 20.0, "aaa", [16, 16])
    _fake_run(tmp_path / "1", "dof", 15.0, "bbb", [14, 18], acc=0.5)
    report = write_report(tmp_path)
    text = report.read_text()
    assert "allocation" in text and "model" not in text.split("\n")[2]  # only distinguishing keys
    assert "runs differ in git" in text
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [r["allocation"] for r in rows] == ["fix", "dof"]
    assert {r["eval/student_ppl"] for r in rows} == {"20.0", "15.0"}
    # dof closes (20 - 15) / (20 - 10) of the gap left by its fix twin
    assert "| allocation=dof | dof | 20 | 15 | 10 | 0.5 |" in text
    assert "tasks/student/avg_acc" in text.split("\n")[2]
    for plot in ("dims.png", "attn_error.png", "dof_heatmap.png", "perplexity.png", "tasks.png", "mqar.png",
                 "gap_closed.png"):
        assert (tmp_path / plot).stat().st_size > 1000
        assert f"({plot})" in text


def test_distinguishing_overrides_ignores_shared_values():
    runs = [{"overrides": ["a=1", "b=2"]}, {"overrides": ["a=1", "b=3"]}, {"overrides": ["a=1"]}]
    assert distinguishing_overrides(runs) == ["b"]


def test_gap_closed_needs_a_fix_twin_with_the_same_config(tmp_path):
    _fake_run(tmp_path / "0", "fix", 20.0, "aaa", [16, 16])
    _fake_run(tmp_path / "1", "dof", 15.0, "aaa", [14, 18])
    run = load_run(tmp_path / "1")
    run["record"]["config"]["model"]["source"] = "other"  # another teacher: not comparable with the fix run
    assert gap_closed([load_run(tmp_path / "0"), run]) == []
    run = load_run(tmp_path / "1")
    run["record"]["config"]["allocation"]["lam"] = 0.5  # how the DoF were estimated: fix ignores it
    assert [c["gap_closed"] for c in gap_closed([load_run(tmp_path / "0"), run])] == [0.5]
    assert [c["gap_closed"] for c in gap_closed([load_run(tmp_path / "0"), load_run(tmp_path / "1")])] == [0.5]


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_the_published_table(df):
    assert abs(t_quantile(0.975, df) - T975[df]) < 6e-4
    assert t_quantile(0.025, df) == pytest.approx(-t_quantile(0.975, df), rel=1e-12)


def test_t_quantile_tends_to_the_normal_and_other_levels_are_right():
    assert t_quantile(0.95, 5) == pytest.approx(2.015, abs=6e-4)  # one-sided 95 %, df 5
    assert t_quantile(0.995, 3) == pytest.approx(5.841, abs=6e-4)
    assert t_quantile(0.975, 100) == pytest.approx(1.984, abs=6e-4)
    assert t_quantile(0.975, 5000) == pytest.approx(1.959964, abs=6e-4)  # the normal quantile, nearly
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-9)
    # fractional degrees of freedom (Welch's) fall between the whole ones around them
    assert T975[3] < t_quantile(0.975, 2.5) < T975[2]
    with pytest.raises(ValueError, match="positive"):
        t_quantile(0.9, 0)
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        t_quantile(1.0, 3)


def test_mean_ci_is_the_student_t_interval_and_covers_95_percent():
    mean, half = mean_ci([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert mean == pytest.approx(7 / 3) and half == pytest.approx(T975[2] * sd / math.sqrt(3), rel=2e-4)
    assert mean_ci([5.0]) == (5.0, None)
    with pytest.raises(ValueError):
        mean_ci([])
    rng = random.Random(0)  # three seeds per setting, as a sweep would have: the interval covers μ
    hits = 0
    for _ in range(4000):
        m, h = mean_ci([rng.gauss(10.0, 2.0) for _ in range(3)])
        hits += abs(m - 10.0) <= h
    assert 0.935 <= hits / 4000 <= 0.965


def test_paired_differences_and_gap_closed():
    assert paired_differences({2: 5.0, 0: 3.0, 1: 4.0}, {0: 1.0, 2: 2.0, 7: 9.0}) == {0: 2.0, 2: 3.0}
    assert gap_share(2.0, 1.5, 1.0) == 0.5
    assert gap_share(2.0, 2.5, 1.0) == -0.5  # worse than fix: a negative share
    assert gap_share(1.0, 0.5, 1.0) is None  # no gap to close


def _seed_sweep(tmp_path, ppl):
    """Fake runs: policy -> per-seed student ppl (teacher ppl 10)."""
    dims = {"fix": [16, 16], "dof": [12, 20], "fix_max": [20, 20]}
    for policy, per_seed in ppl.items():
        for seed, value in enumerate(per_seed):
            _fake_run(tmp_path / f"{policy}_{seed}", policy, value, "aaa", dims[policy], seed=seed)
    write_report(tmp_path)
    return {(r["allocation"], r["seed"]): r for r in csv.DictReader(open(tmp_path / "report.csv"))}


def test_seed_report_shows_means_intervals_and_paired_differences(tmp_path):
    ppl = {"fix": [20.0, 22.0, 21.0], "dof": [18.0, 23.0, 19.0], "fix_max": [17.0]}
    rows = _seed_sweep(tmp_path, ppl)
    fix, dof = rows[("fix", "1")], rows[("dof", "2")]
    assert fix["n_seeds"] == dof["n_seeds"] == "3" and rows[("fix_max", "0")]["n_seeds"] == "1"
    mean = sum(ppl["dof"]) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in ppl["dof"]) / 2)
    assert float(dof["eval/student_ppl_mean"]) == pytest.approx(mean)
    assert float(dof["eval/student_ppl_ci95"]) == pytest.approx(T975[2] * sd / math.sqrt(3), rel=2e-4)
    assert rows[("fix_max", "0")]["eval/student_ppl_ci95"] == ""  # one seed: no interval
    diffs = [math.log(d) - math.log(f) for d, f in zip(ppl["dof"], ppl["fix"])]
    closed = [(math.log(f) - math.log(d)) / (math.log(f) - math.log(10.0)) for d, f in zip(ppl["dof"], ppl["fix"])]
    assert float(dof["vs_fix/loss_diff"]) == pytest.approx(diffs[2])
    assert float(dof["vs_fix/loss_diff_mean"]) == pytest.approx(sum(diffs) / 3)
    sd = math.sqrt(sum((x - sum(diffs) / 3) ** 2 for x in diffs) / 2)
    assert float(dof["vs_fix/loss_diff_ci95"]) == pytest.approx(T975[2] * sd / math.sqrt(3), rel=2e-4)
    assert float(dof["vs_fix/gap_closed_mean"]) == pytest.approx(sum(closed) / 3)
    assert float(dof["vs_fix/ppl_diff_mean"]) == pytest.approx((18 - 20 + 23 - 22 + 19 - 21) / 3)
    assert "vs_fix/loss_diff" not in fix or fix["vs_fix/loss_diff"] == ""
    assert float(rows[("fix_max", "0")]["cost_mean"]) == 20 / 16  # mean dim / budget, beside its quality
    text = (tmp_path / "report.md").read_text()
    assert "Student-t" in text and "(n=1)" in text and "| 0.4 ± 0 |" in text  # equal accuracies: no float noise
    assert f"| dof | dof | 3 | 0,1,2 | 16 ± 0 | 1 ± 0 | {mean:.4g} ± " in text
    assert "| fix_max | fix_max | 1 | 1.25 (n=1) |" in text  # paired row: its cost, one pair
    assert "(gap_closed.png)" in text and (tmp_path / "perplexity.png").stat().st_size > 1000


def test_a_repeated_seed_is_left_out_and_named(tmp_path):
    _fake_run(tmp_path / "a", "fix", 20.0, "aaa", [16, 16], seed=0)
    _fake_run(tmp_path / "b", "fix", 24.0, "aaa", [16, 16], seed=0)
    write_report(tmp_path)
    a, b = csv.DictReader(open(tmp_path / "report.csv"))
    assert (a["n_seeds"], a["eval/student_ppl_mean"]) == ("1", "20.0")
    assert b["n_seeds"] == b["eval/student_ppl_mean"] == ""  # left out: no group statistics
    assert "repeats seed 0" in (tmp_path / "report.md").read_text()


def test_cache_keys_are_compared_only_between_runs_of_one_seed(tmp_path):
    """A tiny random model's weights, hence its cache, depend on the seed: no note for that."""
    for seed, policy, key in ((0, "fix", "k0"), (1, "fix", "k1"), (0, "dof", "k0")):
        _fake_run(tmp_path / f"{policy}{seed}", policy, 20.0, "aaa", [16, 16], seed=seed, cache_key=key)
    runs = [load_run(tmp_path / d) for d in ("fix0", "fix1", "dof0")]
    assert record_differences_within_seeds(runs) == []
    runs[2]["record"]["cache_key"] = "other"  # same seed, another cache: worth a note
    (note,) = record_differences_within_seeds(runs)
    assert note.startswith("runs differ in cache_key") and "other" in note


def test_seeds_evaluated_differently_still_group_and_each_metric_shows_its_n(tmp_path):
    for seed in range(3):
        _fake_run(tmp_path / f"s{seed}", "fix", 20.0 + seed, "aaa", [16, 16], seed=seed)
    for seed in (1, 2):  # these seeds were run without the downstream tasks
        record, metrics = read_json(tmp_path / f"s{seed}/run.json"), read_json(tmp_path / f"s{seed}/metrics.json")
        record["config"]["eval"] = {"tasks": []}
        write_json(tmp_path / f"s{seed}/run.json", record)
        write_json(tmp_path / f"s{seed}/metrics.json", {k: v for k, v in metrics.items() if not k.startswith("tasks/")})
    write_report(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert {r["n_seeds"] for r in rows} == {"3"} and {r["tasks/student/avg_acc_mean"] for r in rows} == {"0.4"}
    assert "| fix | 3 | 0,1,2 | 16 ± 0 | 1 ± 0 | 21 ± 2.5 | 0.4 (n=1) |" in (tmp_path / "report.md").read_text()


def test_a_run_recorded_before_a_config_key_existed_groups_with_its_newer_seeds(tmp_path):
    for seed in range(3):
        _fake_run(tmp_path / f"s{seed}", "dof", 20.0 + seed, "aaa", [14, 18], seed=seed)
    record = read_json(tmp_path / "s2/run.json")
    record["config"]["allocation"]["resamples"] = 1  # the newer run records the key at its old behaviour
    write_json(tmp_path / "s2/run.json", record)
    _fake_run(tmp_path / "other", "dof", 30.0, "aaa", [14, 18], seed=0)
    record = read_json(tmp_path / "other/run.json")
    record["config"]["allocation"]["resamples"] = 16  # another estimate: another group
    write_json(tmp_path / "other/run.json", record)
    groups, _ = seed_groups([load_run(tmp_path / d) for d in ("s0", "s1", "s2", "other")])
    assert sorted(g["seeds"] for g in groups) == [[0], [0, 1, 2]]


def test_each_dof_estimate_pairs_with_the_fix_run_of_its_seed(tmp_path):
    """`fix` ignores how the DoF were estimated, so every estimate's runs share one fix twin."""
    for seed in range(2):
        _fake_run(tmp_path / f"fix{seed}", "fix", 20.0, "aaa", [16, 16], seed=seed)
        for name, resamples, ppl in (("single", 1, 18.0), ("mean16", 16, 15.0)):
            _fake_run(tmp_path / f"{name}{seed}", "dof", ppl, "aaa", [14, 18], seed=seed)
            record = read_json(tmp_path / f"{name}{seed}/run.json")
            record["config"]["allocation"].update(resamples=resamples, num_samples=512 * resamples)
            write_json(tmp_path / f"{name}{seed}/run.json", record)
    runs = [load_run(p) for p in sorted(tmp_path.iterdir())]
    paired = paired_vs_fix(seed_groups(runs)[0])
    assert len(paired) == 2 and all(len(p["per_seed"]) == 2 for p in paired)
    assert sorted(round(p["stats"]["ppl_diff"][0], 6) for p in paired) == [-5.0, -2.0]


def test_a_run_recorded_before_distill_precision_and_micro_batching_groups_with_a_new_default_run():
    from dataclasses import asdict

    from dofla.config import RunConfig
    from dofla.report.seeds import settings_key

    new = asdict(RunConfig())
    old = {k: v for k, v in new.items() if k not in ("distill", "precision")}
    old["train"] = {k: v for k, v in new["train"].items() if k != "micro_batch_size"}
    assert settings_key(old) == settings_key(new)
    assert settings_key(old) != settings_key({**new, "precision": "bf16"})
    assert settings_key(old) != settings_key({**new, "distill": {**new["distill"], "name": "kl"}})
