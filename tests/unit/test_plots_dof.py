"""The DoF profile plot (with its J-sample / seed spread) and the DoF-vs-sensitivity plot."""
from __future__ import annotations

import pytest
import torch

from dofla.dof.algorithm import layer_dof_spread
from dofla.record import write_json
from dofla.report.dof_plots import dof_band, plot_dof_profile, plot_dof_vs_sensitivity
from dofla.report.plots import write_plots
from dofla.report.seeds import seed_groups
from dofla.report.tables import load_run


def _dof_json(seed: int, spread: int = 0) -> dict:
    """dof.json the way dof_stage writes it, on two synthetic layers (spread: J-samples per layer)."""
    settings = {"lambda": 0.01, "num_samples": 32, "gram_norm": "trace", "num_tokens": None, "seed": seed,
                "cache_key": "abc", "head_aggregate": "max", "spread_samples": spread}
    layers = []
    for i, scale in enumerate((0.5, 2.0)):
        g = torch.Generator().manual_seed(seed * 10 + i)
        q, k = torch.randn(200, 2, 8, generator=g) * scale, torch.randn(200, 1, 8, generator=g) * scale
        s = layer_dof_spread(q, k, 0.01, 32, seeds=range(seed + i, seed + i + 1 + spread))
        layers.append((s["values"][0], s))
    out = {"settings": settings, "per_head": [[v, v] for v, _ in layers], "layer_dof": [v for v, _ in layers],
           "warning": None}
    if spread:
        out["spread"] = [{**s, "values": s["values"][1:]} for _, s in layers]
    return out


def _run_dir(path, policy: str, seed: int, spread: int = 0, measured: bool = False):
    dof = _dof_json(seed, spread)
    config = {"allocation": {"policy": policy, "lam": 0.01}, "seed": seed, "model": {"source": "tiny"}}
    write_json(path / "run.json", {"config": config, "overrides": [f"allocation={policy}", f"seed={seed}"],
                                   "seed": seed, "cache_key": "abc"})
    write_json(path / "dof.json", dof)
    allocation = {"policy": policy, "budget": 16, "dims": [12, 20], "layer_dof": dof["layer_dof"],
                  "linear_layers": [0, 1]}
    if measured:
        losses = [[0.9 - 0.1 * seed, 0.5], [1.5, 0.6 + 0.05 * seed]]
        allocation.update(measured_dims=[4, 16], measured_losses=losses, sensitivity=[a - b for a, b in losses],
                          dof_sensitivity_spearman=1.0 - seed)
    write_json(path / "allocation.json", allocation)
    return load_run(path)


def test_band_spans_seeds_and_j_samples():
    one, two = _dof_json(0, spread=3), _dof_json(1, spread=3)
    means, lo, hi = dof_band([one, two])
    for i in range(2):
        values = [one["layer_dof"][i], two["layer_dof"][i], *one["spread"][i]["values"], *two["spread"][i]["values"]]
        assert means[i] == pytest.approx((one["layer_dof"][i] + two["layer_dof"][i]) / 2)
        assert (lo[i], hi[i]) == (min(values), max(values)) and lo[i] < hi[i]
    assert dof_band([_dof_json(0)])[1] == dof_band([_dof_json(0)])[2]  # one estimate: no bar


def test_profile_written_from_runs_and_skipped_without_dof(tmp_path):
    runs = [_run_dir(tmp_path / f"r{s}", "dof", s, spread=2) for s in range(2)]
    assert plot_dof_profile(runs, tmp_path / "dof_profile.png").stat().st_size > 1000
    for run in runs:
        run["dof"] = {}
    assert plot_dof_profile(runs, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_sensitivity_plot_needs_measured_runs(tmp_path):
    plain = [_run_dir(tmp_path / f"d{s}", "dof", s) for s in range(2)]
    assert plot_dof_vs_sensitivity(seed_groups(plain)[0], tmp_path / "none.png") is None
    measured = [_run_dir(tmp_path / f"m{s}", "measured", s, measured=True) for s in range(3)]
    groups = seed_groups(plain + measured)[0]
    assert [len(g["runs"]) for g in groups] == [2, 3]
    assert plot_dof_vs_sensitivity(groups, tmp_path / "dvs.png").stat().st_size > 1000


def test_write_plots_adds_both_for_a_sweep(tmp_path):
    runs = [_run_dir(tmp_path / f"{p}{s}", p, s, spread=2, measured=p == "measured")
            for p in ("dof", "measured") for s in range(2)]
    made = {p.name for p in write_plots(runs, tmp_path)}
    assert {"dof_profile.png", "dof_vs_sensitivity.png"} <= made
    assert (tmp_path / "dof_vs_sensitivity.png").stat().st_size > 1000


def test_runs_sharing_a_dof_result_count_once(tmp_path):
    from dofla.report.dof_plots import _dof_sets

    runs = [_run_dir(tmp_path / name, policy, seed) for name, policy, seed in
            (("a", "dof", 0), ("b", "measured", 0), ("c", "dof", 1))]
    (label, dofs), = _dof_sets(runs)
    assert label.startswith("J=32, max over heads") and label.endswith("(2 seeds)") and len(dofs) == 2
    runs[2]["dof"]["settings"]["num_samples"] = 64
    assert sorted(len(d) for _, d in _dof_sets(runs)) == [1, 1]
    runs[2]["dof"] = {"layer_dof": [1.0, 2.0], "per_head": [[1.0], [2.0]]}  # an old dof.json, no settings
    assert [label for label, _ in _dof_sets(runs)][-1] == "layer DoF (1 seed)"


def test_a_layer_algorithm_1_skipped_is_a_gap_in_the_band_and_heatmap(tmp_path):
    from dofla.report.dof_plots import plot_dof_heatmap

    one, two = _dof_json(0, spread=2), _dof_json(1, spread=2)
    full = dof_band([one, two])
    for dof in (one, two):  # layer 0 kept exact (a teacher sliding-window layer): dof.json has null
        dof["layer_dof"][0] = dof["per_head"][0] = dof["spread"][0] = None
    means, lo, hi = dof_band([one, two])
    assert all(x != x for x in (means[0], lo[0], hi[0]))  # NaN
    assert (means[1], lo[1], hi[1]) == (full[0][1], full[1][1], full[2][1])
    run = _run_dir(tmp_path / "r", "dof", 0)
    run["dof"] = one
    assert plot_dof_heatmap([run], tmp_path / "heat.png").stat().st_size > 1000
    assert plot_dof_profile([run], tmp_path / "profile.png").stat().st_size > 1000
