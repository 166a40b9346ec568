"""The real ``dofla`` command on the tiny model for the paths beyond the default run: the training-free
sliding-window baseline, streaming training (with a kill and resume), the measured allocation, the
hybrid's probes, and a family whose teacher has sliding-window layers."""
from __future__ import annotations

import json
import math
import signal

import pytest
import torch

from dofla.cache import predict_cache_bytes
from dofla.models import get_adapter, load_student
from dofla.models.tiny import build_tiny_model
from tests.conftest import activation_caches, reproducible
from tests.integration.test_pipeline import run_cli

SMOKE = ["experiment=smoke_tiny"]


def _run(tmp_path, *overrides, name="run", env=None):
    run_dir = tmp_path / name
    result = run_cli(*SMOKE, f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'cache'}", *overrides, env=env)
    return run_dir, result


def _metrics(run_dir):
    return reproducible(json.loads((run_dir / "metrics.json").read_text()))


def test_sliding_window_baseline_trains_nothing_and_caches_no_activations(tmp_path):
    run_dir, result = _run(tmp_path, "attention=sliding_window", "attention.window=8", "attention.sinks=2")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = _metrics(run_dir)
    assert math.isfinite(metrics["eval/student_ppl"]) and metrics["eval/attn_error/mean"] > 0
    assert metrics["train/tokens"] == 0 and metrics["cache/bytes"] == 0
    assert not (run_dir / "allocation.json").exists() and not (run_dir / "layers").exists()
    assert activation_caches(tmp_path / "cache") == []  # only the teacher's shared scores are kept
    student = load_student(run_dir / "student")
    assert {a.mode for a in student.student_attentions()} == {"sliding_window"}
    assert student.config.dofla["sinks"] == 2


STREAM = ["train.source=stream", "data.num_tokens=2048", "data.cache_tokens=256", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    run_dir, result = _run(root, *STREAM)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_streaming_run_caches_only_the_sample_and_reports_tokens(streamed):
    run_dir, result = streamed
    assert "a stream of fresh teacher activations" in result.stdout
    metrics = _metrics(run_dir)
    batch_tokens = 2 * 64  # train=smoke batch 2 × smoke_tiny's seq_len 64
    assert metrics["train/tokens"] == (2048 // batch_tokens) * batch_tokens
    geometry = get_adapter(build_tiny_model("llama")).geometry(build_tiny_model("llama").config)
    sample = predict_cache_bytes(geometry, 256 // 64, 64)  # the arrays; the manifest and meta add ~1 KB
    assert sample <= metrics["cache/bytes"] <= sample + 4096 < predict_cache_bytes(geometry, 2048 // 64, 64)
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert all(layer["tokens"] == metrics["train/tokens"] for layer in summary.values())


@pytest.mark.long
def test_a_compiled_streaming_run_learns_the_eager_runs_features(streamed, tmp_path):
    """``train.compile=true`` through the real CLI: the same streamed steps, the loss compiled."""
    run_dir, result = _run(tmp_path, *STREAM, "train.compile=true", name="compiled")
    assert result.returncode == 0, result.stderr[-3000:]
    eager, compiled = load_student(streamed[0] / "student"), load_student(run_dir / "student")
    for a, b in zip(eager.student_attentions(), compiled.student_attentions()):
        for (name, x), y in zip(a.feature_map.state_dict().items(), b.feature_map.state_dict().values()):
            torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.long
def test_killed_streaming_run_resumes_to_the_same_result(streamed, tmp_path):
    baseline, _ = streamed
    run_dir, killed = _run(tmp_path, *STREAM, env={"DOFLA_KILL_AT": "stream:step5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir, resumed = _run(tmp_path, *STREAM)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(run_dir) == _metrics(baseline)


@pytest.mark.long
def test_a_killed_streaming_run_never_resumes_under_other_settings(tmp_path):
    """Killed at step 5, then re-run in the same directory with another loss and learning rate: the
    checkpoint is ignored and the result is that of a fresh run with the new settings."""
    changed = [*STREAM, "loss=output", "train.lr_z=0.01"]
    fresh, result = _run(tmp_path, *changed, name="fresh")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, killed = _run(tmp_path, *STREAM, env={"DOFLA_KILL_AT": "stream:step5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list((run_dir / "layers").glob("stream_*.ckpt"))
    run_dir, rerun = _run(tmp_path, *changed)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "was written for other settings" in rerun.stdout
    assert _metrics(run_dir) == _metrics(fresh)


def test_a_bf16_teacher_streams_close_to_the_fp32_one_under_its_own_cache_key(streamed, tmp_path):
    baseline, _ = streamed
    run_dir, result = _run(tmp_path, *STREAM, "train.teacher_dtype=bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    keys = [json.loads((d / "run.json").read_text())["cache_key"] for d in (baseline, run_dir)]
    assert keys[0] != keys[1]  # bf16 activations never mix with fp32 ones in a cache
    meta = torch.load(next((run_dir / "layers").glob("layer_*.pt")), weights_only=False)["meta"]
    assert meta["train"]["teacher_dtype"] == "bfloat16"
    fp32_meta = torch.load(next((baseline / "layers").glob("layer_*.pt")), weights_only=False)["meta"]
    assert "teacher_dtype" not in fp32_meta["train"]  # the default leaves older artifacts valid
    ours, theirs = _metrics(run_dir), _metrics(baseline)
    assert ours["eval/teacher_ppl"] == theirs["eval/teacher_ppl"]  # evaluation keeps the fp32 teacher
    ours, theirs = ours["eval/attn_error/mean"], theirs["eval/attn_error/mean"]
    assert ours != theirs and ours == pytest.approx(theirs, rel=0.05)  # trained on rounded activations


DIRECT_STREAM = ["loss=direct", "train.source=stream", "data.num_tokens=1024", "data.cache_tokens=256",
                 "train.direct_batch_size=2", "train.checkpoint_every=2"]


@pytest.mark.long
def test_direct_training_streams_one_pass_and_resumes_after_a_kill(tmp_path):
    baseline, result = _run(tmp_path, *DIRECT_STREAM, name="baseline")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a stream of fresh token batches (end to end)" in result.stdout
    metrics = _metrics(baseline)
    batch_tokens = 2 * 64  # train.direct_batch_size 2 × smoke_tiny's seq_len 64
    assert metrics["train/tokens"] == (1024 // batch_tokens) * batch_tokens
    done = json.loads(next((baseline / "layers").glob("direct_done.json")).read_text())
    assert done["steps"] == 1024 // batch_tokens and done["tokens"] == metrics["train/tokens"]
    run_dir, killed = _run(tmp_path, *DIRECT_STREAM, env={"DOFLA_KILL_AT": "train:direct:step5"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir, resumed = _run(tmp_path, *DIRECT_STREAM)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(run_dir) == metrics


def test_measured_allocation_shares_the_budget_by_measured_curves(tmp_path):
    run_dir, result = _run(tmp_path, "allocation=measured", "allocation.measured_dims=[4,16,48]",
                           "allocation.measured_steps=3", "budget=absolute", "budget.value=24",
                           "allocation.resamples=3", "allocation.spread_samples=2")
    assert result.returncode == 0, result.stderr[-3000:]
    dof = json.loads((run_dir / "dof.json").read_text())  # Algorithm 1 ran beside: averaged, with its spread
    assert dof["settings"]["resamples"] == 3
    assert len(dof["samples"]) == 2 and all(len(values) == 3 for values in dof["samples"])
    assert all(len(s["values"]) == 2 for s in dof["spread"])
    allocation = json.loads((run_dir / "allocation.json").read_text())
    assert allocation["policy"] == "measured" and sum(allocation["dims"]) == 2 * 24
    assert all(4 <= m <= 48 for m in allocation["dims"])
    assert len(allocation["measured_losses"]) == 2 and all(len(c) == 3 for c in allocation["measured_losses"])
    assert "dof_sensitivity_spearman" in allocation and (run_dir / "measured.json").exists()
    assert math.isfinite(_metrics(run_dir)["eval/student_ppl"])


def test_hybrid_probes_ablation_window_mass_positions_passkey(tmp_path):
    """Also the ``output`` loss through the cache path (it reads the cached values)."""
    run_dir, result = _run(tmp_path, "attention=hybrid", "attention.window=8", "attention.sinks=2", "loss=output",
                           "eval.ablate_linear=true", "eval.window_mass=true", "eval.position_buckets=[1,16,40,64]",
                           "eval.passkey_lengths=[96]", "eval.passkey_trials=1")
    assert result.returncode == 0, result.stderr[-3000:]
    m = _metrics(run_dir)
    assert m["ablate/linear_gain_loss"] == pytest.approx(m["ablate/student_loss"] - m["eval/student_loss"])
    assert m["ablate/student_loss"] != m["eval/student_loss"]  # the linear part does change the output
    assert 0 < m["window_mass/mean"] < 1
    assert {f"position/{w}/{b}" for w in ("teacher", "student") for b in ("1-16", "16-40", "40-64")} <= set(m)
    assert {"passkey/teacher/T96", "passkey/student/T96"} <= set(m)
    assert m["passkey_nll/student/T96"] > 0 and m["passkey_nll/teacher/T96"] > 0


def test_teacher_sliding_layers_stay_exact_and_get_no_features(tmp_path):
    run_dir, result = _run(tmp_path, "model.source=tiny:gemma2", "model.name=tiny_gemma2")
    assert result.returncode == 0, result.stderr[-3000:]
    allocation = json.loads((run_dir / "allocation.json").read_text())
    assert allocation["linear_layers"] == [1] and allocation["dims"][0] == 0 and allocation["dims"][1] > 0
    metrics = _metrics(run_dir)
    assert metrics["eval/attn_error/layer_00"] < 1e-5 < metrics["eval/attn_error/layer_01"]
    assert not (run_dir / "layers" / "layer_00.pt").exists() and (run_dir / "layers" / "layer_01.pt").exists()


def test_a_run_keeping_the_best_layer_exact_reports_it_and_distils_around_it_with_far_copies(tmp_path):
    run_dir, result = _run(tmp_path, "allocation=fix", "allocation.softmax_layers=1", "allocation.softmax_probe_seqs=2",
                           "distill=kl", "distill.tokens=256", "distill.batch_size=2", "distill.copy_share=0.25",
                           "distill.copy_distance=16")
    assert result.returncode == 0, result.stderr[-3000:]
    settings = json.loads((run_dir / "distill_summary.json").read_text())["settings"]["distill"]
    assert settings["copy_share"] == 0.25 and settings["copy_distance"] == 16  # far copies in the KL text
    chosen = json.loads((run_dir / "softmax_layers.json").read_text())
    assert "keeping layers" in result.stdout and len(chosen["layers"]) == 1
    metrics = _metrics(run_dir)
    assert metrics["softmax_layers/count"] == 1 and metrics["softmax_layers/kv_bytes_per_token"] > 0
    student = load_student(run_dir / "student_distilled")
    modes = [a.mode for a in student.student_attentions()]
    assert modes[chosen["layers"][0]] == "softmax" and modes.count("linear") == len(modes) - 1
    assert metrics[f"eval/attn_error/layer_{chosen['layers'][0]:02d}"] == 0  # exact
    assert math.isfinite(metrics["eval/student_ppl"])
    from studies.paired_heldout import compare  # the paired study reads the run: a run against itself is 0

    assert compare([run_dir, run_dir]).splitlines()[-1].endswith("| +0.0000 ± 0.0000 |")


@pytest.mark.long
def test_a_hybrid_trained_against_full_attention_shares_the_linear_runs_layers(tmp_path):
    """``train.hybrid_target=full``: the layerwise stage trains exactly the linear layers (one shared
    layer directory, nothing retrained); window dropout then distils the hybrid."""
    layers = tmp_path / "layers"
    linear_dir, result = _run(tmp_path, "allocation=fix", f"train.layer_dir={layers}", "eval.tasks=[]", name="linear")
    assert result.returncode == 0, result.stderr[-3000:]
    written = {p.name: p.stat().st_mtime_ns for p in layers.glob("layer_*.pt")}
    run_dir, result = _run(tmp_path, "allocation=fix", f"train.layer_dir={layers}", "attention=hybrid",
                           "attention.window=8", "attention.sinks=2", "train.hybrid_target=full", "distill=kl",
                           "distill.tokens=256", "distill.batch_size=2", "distill.window_dropout=0.9",
                           "distill.window_dropout_end=0.5", name="hybrid")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in layers.glob("layer_*.pt")} == written  # reused, not retrained
    linear, hybrid = load_student(linear_dir / "student"), load_student(run_dir / "student")
    assert {a.mode for a in hybrid.student_attentions()} == {"hybrid"}
    for a, b in zip(linear.student_attentions(), hybrid.student_attentions()):
        for (name, x), y in zip(a.feature_map.state_dict().items(), b.feature_map.state_dict().values()):
            torch.testing.assert_close(x, y, msg=name)
    settings = json.loads((run_dir / "distill_summary.json").read_text())["settings"]["distill"]
    assert settings["window_dropout"] == 0.9 and settings["window_dropout_end"] == 0.5
    distilled = load_student(run_dir / "student_distilled")
    assert {a.mode for a in distilled.student_attentions()} == {"hybrid"}
    assert math.isfinite(_metrics(run_dir)["eval/student_ppl"])
    from studies.paired_heldout import compare  # the linear part's share, paired against the run itself

    rows = compare([linear_dir, run_dir], ablate=True).splitlines()[-3:]
    assert [r.split(" | ")[0] for r in rows] == ["| linear", "| hybrid", "| hybrid, linear part removed (vs itself)"]
    assert not rows[-1].endswith("| +0.0000 ± 0.0000 |")  # removing the linear part changes the loss


HYBRID_RUN = ("attention=hybrid", "attention.window=8", "attention.sinks=2")


@pytest.mark.long
@pytest.mark.parametrize(("form", "scale"), [((), ()), (HYBRID_RUN, ()),
                                             (HYBRID_RUN, ("attention.linear_scale=learned",))],
                         ids=["linear", "hybrid", "hybrid with a learned linear scale"])
def test_a_gated_run_shares_the_layers_and_distils_the_gate(tmp_path, form, scale):
    layers = tmp_path / "layers"  # the ungated run has no distill stage, so no learned scale either
    _, result = _run(tmp_path, "allocation=fix", f"train.layer_dir={layers}", "eval.tasks=[]", *form, name="ungated")
    assert result.returncode == 0, result.stderr[-3000:]
    written = {p.name: p.stat().st_mtime_ns for p in layers.glob("layer_*.pt")}
    run_dir, result = _run(tmp_path, "allocation=fix", f"train.layer_dir={layers}", "attention.gate=scalar", *form,
                           *scale, "distill=kl", "distill.tokens=256", "distill.batch_size=2",
                           "distill.train=[features,attention,gate]", "eval.tasks=[]", name="gated")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in layers.glob("layer_*.pt")} == written  # the same layers
    student = load_student(run_dir / "student_distilled")
    assert student.config.dofla["gate"] == "scalar"
    alphas = torch.cat([a.gate.alpha for a in student.student_attentions()])
    assert (alphas >= 0).all() and alphas.max() > 0
    card = (run_dir / "student_distilled" / "README.md").read_text()
    assert "decay gate" in card
    if scale:  # the same layers, and the scale trained with the features
        assert student.config.dofla["linear_scale"] == "learned" and "learned per-head scale" in card
        assert torch.cat([a.linear_log_scale for a in student.student_attentions()]).abs().max() > 0
    assert math.isfinite(_metrics(run_dir)["eval/student_ppl"])


@pytest.mark.long
def test_the_greedy_choice_of_exact_layers_is_extended_by_a_larger_k(tmp_path):
    layers = tmp_path / "layers"
    common = ("allocation=fix", "model.tiny_layers=4", f"train.layer_dir={layers}", "allocation.softmax_probe_seqs=2",
              "allocation.softmax_rank=kl_greedy", "eval.tasks=[]")
    first, result = _run(tmp_path, *common, "allocation.softmax_layers=2", name="k2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "chosen one after another" in result.stdout
    (ranking,) = layers.glob(f"*/{'softmax_ranking.json'}")
    greedy = json.loads(ranking.read_text())["measured"]["greedy"]
    assert len(greedy) == 2 and json.loads((first / "softmax_layers.json").read_text())["layers"] == \
        sorted(s["layer"] for s in greedy)
    second, result = _run(tmp_path, *common, "allocation.softmax_layers=3", name="k3")
    assert result.returncode == 0, result.stderr[-3000:]
    extended = json.loads(ranking.read_text())["measured"]["greedy"]
    assert extended[:2] == greedy and len(extended) == 3  # the first two steps read, the third measured
    modes = [a.mode for a in load_student(second / "student").student_attentions()]
    assert modes.count("softmax") == 3
