"""dofla-report --table tokens (dofla.report.tokens): seeds grouped per (label, tokens), Student-t intervals, per-layer table."""
from __future__ import annotations

import json
import math

import pytest

from dofla.report.tokens import collect, group, layer_table, layers_path, main, short_tokens

T_975_1 = 12.706  # Student t, 0.975 quantile, 1 degree of freedom (tables)


def _run(root, name, tokens, seed, ppl, layers, policy="dof", attention="linear", teacher=10.0, drop_tokens=False):
    run = root / name
    run.mkdir(parents=True)
    metrics = {"eval/student_ppl": ppl, "eval/teacher_ppl": teacher, "train/tokens": tokens,
               "eval/attn_error/mean": sum(layers) / len(layers)}
    metrics.update({f"eval/attn_error/layer_{i:02d}": v for i, v in enumerate(layers)})
    if drop_tokens:
        del metrics["train/tokens"]
    config = {"seed": seed, "feature_map": {"name": "learned_prf"}, "allocation": {"policy": policy},
              "attention": {"name": attention, "window": 8, "sinks": 1}, "loss": {"name": "softmax"},
              "train": {"source": "cache"}}
    (run / "metrics.json").write_text(json.dumps(metrics))
    (run / "run.json").write_text(json.dumps({"config": config}))
    return run


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    _run(root, "a_s0", 1024, 0, 20.0, [0.5, 0.6, 0.7])
    _run(root, "a_s1", 1024, 1, 24.0, [0.3, 0.4, 0.9])
    _run(root, "b_s0", 4096, 0, 15.0, [0.2, 0.3, 0.4])
    _run(root, "zero_tokens", 0, 0, 99.0, [0.9, 0.9, 0.9])
    _run(root, "no_tokens", 0, 0, 99.0, [0.9, 0.9, 0.9], drop_tokens=True)
    return root


def test_collect_skips_runs_without_tokens(sweep):
    rows = collect([sweep])
    assert sorted(r["run"].rsplit("/", 1)[-1] for r in rows) == ["a_s0", "a_s1", "b_s0"]
    a0 = next(r for r in rows if r["run"].endswith("a_s0"))
    assert a0["layers"] == [0.5, 0.6, 0.7] and a0["seed"] == 0 and a0["label"] == "learned_prf, dof"


def test_group_mean_and_student_t_interval(sweep):
    points = group(collect([sweep]))
    assert [(p["label"], p["tokens"], p["n"]) for p in points] == [("learned_prf, dof", 1024, 2),
                                                                   ("learned_prf, dof", 4096, 1)]
    two, one = points
    assert two["seeds"] == [0, 1]
    assert two["ppl"] == pytest.approx(22.0)
    sd = math.sqrt((20.0 - 22.0) ** 2 + (24.0 - 22.0) ** 2)  # n − 1 = 1
    assert two["ppl_half"] == pytest.approx(T_975_1 * sd / math.sqrt(2), rel=1e-4)
    assert two["attn"] == pytest.approx((0.6 + 0.5333333) / 2, rel=1e-5)
    assert two["layers"] == pytest.approx([0.4, 0.5, 0.8])
    assert one["ppl"] == 15.0 and one["ppl_half"] is None and one["attn_half"] is None
    assert one["layers"] == pytest.approx([0.2, 0.3, 0.4])


def test_layer_table_rows_are_layers_columns_are_points(sweep):
    table = layer_table(group(collect([sweep]))).splitlines()
    assert table[0] == "| layer | learned_prf, dof @ 1k | learned_prf, dof @ 4k |"
    body = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert body == [["0", "0.400", "0.200"], ["1", "0.500", "0.300"], ["2", "0.800", "0.400"]]


def test_hybrid_runs_get_their_own_label_and_depths_must_agree(tmp_path):
    _run(tmp_path, "lin", 1024, 0, 20.0, [0.5, 0.6, 0.7])
    _run(tmp_path, "hyb", 1024, 0, 12.0, [0.1, 0.2, 0.3], attention="hybrid")
    labels = {p["label"] for p in group(collect([tmp_path]))}
    assert labels == {"learned_prf, dof", "learned_prf, dof, hybrid w8 s1"}
    _run(tmp_path, "lin_deeper", 1024, 1, 21.0, [0.5, 0.6, 0.7, 0.8])
    with pytest.raises(ValueError, match="different layer counts"):
        group(collect([tmp_path]))


def test_main_prints_both_tables_and_writes_both_pngs(sweep, tmp_path, capsys):
    out = tmp_path / "fig" / "qvt.png"
    main([str(sweep), "--out", str(out)])
    printed = capsys.readouterr().out
    half = T_975_1 * math.sqrt(8.0) / math.sqrt(2)
    assert f"| learned_prf, dof | 1,024 | 2 | 0, 1 | 22.00 ± {half:.2f} |" in printed
    assert "| learned_prf, dof | 4,096 | 1 | 0 | 15.00 | 0.300 |" in printed
    assert "| 2 | 0.800 | 0.400 |" in printed
    for path in (out, layers_path(out)):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    explicit = tmp_path / "layers.png"
    main([str(sweep), "--out", str(out), "--layers-out", str(explicit)])
    assert explicit.read_bytes()[:4] == b"\x89PNG"


def test_main_without_finished_runs_says_so(tmp_path):
    _run(tmp_path, "zero", 0, 0, 9.0, [0.1])
    with pytest.raises(SystemExit, match="no finished runs with train/tokens"):
        main([str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_short_tokens_and_layers_path(tmp_path):
    budgets = (1024, 65536, 262144, 917504, 1 << 20, 1000)
    assert [short_tokens(t) for t in budgets] == ["1k", "64k", "256k", "896k", "1M", "1,000"]
    assert layers_path(tmp_path / "q.png") == tmp_path / "q_layers.png"
