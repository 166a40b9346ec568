"""Each headline preset (conf/experiment) runs end to end on a tiny model: the same stages, options and
evaluation protocol as on the embedded SmolLM2, only smaller, and its run record holds what the results
pages are built from (a held-out loss per sequence, a passkey result per prompt)."""
from __future__ import annotations

import json

import pytest

from dofla.report import load_records
from studies import records, results
from tests.integration.test_pipeline import run_cli

# the presets' own settings, scaled to a 2-layer random Llama and 64-token text
SMALL = ["model=tiny_llama", "train=smoke", "data.seq_len=64", "data.num_tokens=512", "data.cache_tokens=256",
         "data.heldout_tokens=256", "distill.tokens=256", "distill.seq_len=128", "eval.long_seq_len=128",
         "eval.long_context_seqs=2", "eval.position_buckets=[1,32,64,128]", "eval.passkey_lengths=[96]",
         "eval.passkey_trials=2"]
PRESETS = {preset: [] for _, preset in results.HEADLINE}
PRESETS["hybrid_recall"] = ["allocation.softmax_layers=1", "eval.passkey_lengths=[96,128]", "distill.copy_distance=16"]
PRESETS["hybrid_copy"] = ["eval.passkey_lengths=[96,128]", "distill.copy_distance=16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every preset's run under root/runs/<preset>: the presets without extra settings as one multirun
    (one process: a CLI start costs ~10 s of imports here), each other one on its own."""
    root = tmp_path_factory.mktemp("presets")
    shared = [*SMALL, f"paths.cache_dir={root / 'cache'}", f"train.layer_dir={root / 'layers'}"]
    plain = [preset for preset, extra in PRESETS.items() if not extra]
    calls = [("-m", "experiment=" + ",".join(plain), f"hydra.sweep.dir={root / 'runs'}", "hydra.sweep.subdir=${experiment}")]
    calls += [(f"experiment={preset}", *extra, f"hydra.run.dir={root / 'runs' / preset}")
              for preset, extra in PRESETS.items() if extra]
    for call in calls:
        result = run_cli(*call, *shared, timeout=1200)
        assert result.returncode == 0, f"{call[:2]}: {result.stderr[-3000:]}"
    assert sorted(p.name for p in (root / "runs").iterdir() if p.is_dir()) == sorted(PRESETS)
    return root


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_preset_trains_evaluates_and_keeps_its_record(runs, preset):
    run = runs / "runs" / preset
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["experiment"] == preset and config["data"]["shuffle_seed"] == config["seed"] == 0
    records.main([str(run), "--into", str(runs / "records")])
    (record,) = [r for r in load_records(runs / "records") if r.experiment == preset]
    assert len(record.sequences["heldout/student"]) == len(record.sequences["heldout/teacher"]) == 4  # 256 / 64
    assert len(record.sequences["passkey/student/T96"]) == 2 and "distill/kl_last" in record.metrics
    assert len(record.sequences["position/student/64-128"]) == 2


def test_the_headline_tables_build_from_the_presets_records(runs):
    records.main([str(runs / "runs"), "--into", str(runs / "all")])
    blocks = results.headline(load_records(runs / "all"))
    for _, preset in results.HEADLINE:
        assert f"`{preset}`" in blocks[("headline", "main")]
    assert "hybrid − window + sinks, held-out loss (nats)" in blocks[("headline", "comparisons")]
    assert "recall hybrid − copy-text control, passkey @ 1K" in blocks[("headline", "comparisons")]


def test_the_frontier_puts_every_preset_against_its_decode_memory(runs, tmp_path):
    from dofla.cli import report_main

    report_main(["--frontier", str(runs / "runs"), "--out", str(tmp_path)])
    table = (tmp_path / "frontier.md").read_text()
    assert (tmp_path / "frontier.png").stat().st_size > 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines()[4:]}
    assert set(rows) == {"teacher", *PRESETS}
    mib = {name: (float(r[-2]), float(r[-1].strip(" |"))) for name, r in rows.items()}
    assert mib["teacher"][1] == pytest.approx(4 * mib["teacher"][0], rel=0.01)  # every key and value kept
    assert mib["linear_hedgehog_kl"][0] == mib["linear_hedgehog_kl"][1]  # a fixed-size state
    assert mib["hybrid_recall"][1] > mib["hybrid_recall"][0]  # its exact layer keeps every key
