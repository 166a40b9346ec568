"""Each stage called directly on a tiny run context, in pipeline order (no CLI, no pipeline.run):
what it returns, what it writes, and that a second call reuses its artifact."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from dofla.cli import CONF_DIR, to_run_config
from dofla.config import DistillConfig
from dofla.stages import allocate, assemble, cache, data, distill, dof, finetune, keys, report, train
from dofla.stages import eval as evaluation
from dofla.stages.context import RunContext, StageTimer
from dofla.stages.plan import stage_plan, train_plan
from dofla.stages.students import linear_layers
from dofla.tracking import NullTracker


def tiny_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["experiment=smoke_tiny", *overrides]))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run context and every stage's result, computed once in order."""
    from dofla.models import get_adapter, load_teacher

    root = tmp_path_factory.mktemp("stages")
    cfg = tiny_config(f"paths.cache_dir={root / 'cache'}", "train.source=cache", "finetune=lora", "finetune.steps=2")
    teacher, tokenizer = load_teacher(cfg.model.source, seed=cfg.seed, num_layers=cfg.model.tiny_layers)
    geometry = get_adapter(teacher).geometry(teacher.config)
    ctx = RunContext(cfg, root / "run", tuple(stage_plan(cfg)), teacher, tokenizer, geometry, teacher,
                     train_plan(cfg, "cache"))
    out = {"ctx": ctx, "data": data.run(ctx)}
    out["cache"] = cache.run(ctx, out["data"])
    out["dof"] = dof.run(ctx, out["cache"], linear_layers(cfg, geometry))
    out["allocation"] = allocate.run(ctx, out["dof"], out["cache"])
    out["dims"] = out["allocation"].dims
    out["train"] = train.run(ctx, out["cache"], out["dims"], out["data"])
    out["assembled"] = assemble.run(ctx, out["dims"], out["data"].cache_key)
    out["student"] = out["assembled"].student
    out["finetuned"] = finetune.run(ctx, copy.deepcopy(out["student"]), out["data"]).student  # LoRA merges in place
    return out


def test_data_packs_tokens_and_names_the_cache(run):
    tokens, cfg = run["data"], run["ctx"].cfg
    assert tokens.train_tokens.shape == (cfg.data.num_tokens // cfg.data.seq_len, cfg.data.seq_len)
    assert tokens.heldout_tokens.shape[1] == cfg.data.seq_len
    assert tokens.cache_key == run["cache"].key


def test_cache_dof_and_allocate_write_their_artifacts(run):
    ctx = run["ctx"]
    assert run["cache"].meta["num_layers"] == 2
    assert json.loads((ctx.out_dir / "dof.json").read_text()) == run["dof"].record
    assert len(run["dof"].layer_dof) == len(run["dof"].per_head) == 2
    assert run["dof"].warning == run["dof"].record["warning"]
    allocation = json.loads((ctx.out_dir / "allocation.json").read_text())
    assert allocation == run["allocation"].record
    assert allocation["dims"] == run["dims"] and sum(run["dims"]) / 2 == pytest.approx(allocation["budget"], abs=1)


def test_train_returns_every_layers_summary_and_reuses_its_artifacts(run):
    ctx, result = run["ctx"], run["train"]
    assert set(result.summaries) == {0, 1} and result.direct is None and result.tokens() is None
    assert all(s["final_heldout_loss"] <= s["initial_heldout_loss"] for s in result.summaries.values())
    before = {p: p.stat().st_mtime_ns for p in (ctx.out_dir / "layers").glob("layer_*.pt")}
    again = train.run(ctx, run["cache"], run["dims"], run["data"])
    assert again.summaries.keys() == result.summaries.keys()
    assert {p: p.stat().st_mtime_ns for p in before} == before  # loaded, not retrained


def test_assemble_and_finetune_write_model_directories(run):
    ctx = run["ctx"]
    assert (ctx.out_dir / "student" / "config.json").exists()
    assert (ctx.out_dir / "student_finetuned" / "dofla_settings.json").exists()
    assert run["finetuned"].dofla_settings["student"] == run["student"].dofla_settings == keys.student_settings(
        ctx.cfg, run["data"].cache_key, run["dims"])
    reused = assemble.run(ctx, run["dims"], run["data"].cache_key).student
    assert run["assembled"].softmax_layers == []
    ids = run["data"].heldout_tokens[:1]
    with torch.no_grad():
        assert torch.equal(reused(ids, use_cache=False).logits, run["student"](ids, use_cache=False).logits)


def test_distill_trains_on_fresh_text_writes_a_student_and_reuses_it(run):
    ctx = dataclasses.replace(run["ctx"], cfg=dataclasses.replace(
        run["ctx"].cfg, distill=DistillConfig(name="kl", tokens=256, batch_size=2, micro_batch_size=1,
                                              checkpoint_every=1)))
    assert distill.offset(ctx, run["data"]) == ctx.cfg.data.num_tokens  # the cached tokens are not read again
    result = distill.run(ctx, copy.deepcopy(run["student"]), run["data"])
    assert result.tokens == 256 and result.student.dofla_settings == keys.distill_settings(
        ctx.cfg, run["student"].dofla_settings)
    target = ctx.out_dir / distill.TARGET
    assert (target / "config.json").exists() and not (ctx.out_dir / "distill_ckpt.pt").exists()
    summary = json.loads((ctx.out_dir / "distill_summary.json").read_text())
    assert [c["step"] for c in summary["curve"]] == [0, 1]
    before = (target / "model.safetensors").stat().st_mtime_ns
    again = distill.run(ctx, copy.deepcopy(run["student"]), run["data"])
    assert again.tokens == 256 and (target / "model.safetensors").stat().st_mtime_ns == before
    ids = run["data"].heldout_tokens[:1]
    with torch.no_grad():
        assert torch.equal(again.student(ids, use_cache=False).logits, result.student(ids, use_cache=False).logits)
        assert not torch.equal(result.student(ids, use_cache=False).logits, run["student"](ids, use_cache=False).logits)


def test_a_long_cpu_run_under_device_auto_is_warned_about(run, capsys):
    ctx = run["ctx"]
    cfg = dataclasses.replace(ctx.cfg, device="auto", data=dataclasses.replace(ctx.cfg.data, num_tokens=10**10))
    data.plan_training(cfg, list(ctx.plan), ctx.geometry, ctx.teacher)
    assert "WARNING: no GPU is visible" in capsys.readouterr().out
    data.plan_training(dataclasses.replace(cfg, device="cpu"), list(ctx.plan), ctx.geometry, ctx.teacher)
    assert "WARNING" not in capsys.readouterr().out  # asked for the CPU: no surprise to warn about


def test_eval_and_report(run):
    from dofla.record import build_record, write_json

    ctx = run["ctx"]
    metrics = evaluation.run(ctx, run["finetuned"], run["data"]).metrics
    write_json(ctx.out_dir / "metrics.json", metrics)
    write_json(ctx.out_dir / "run.json", {**build_record(ctx.cfg, []), "cache_key": run["data"].cache_key})
    assert {"eval/teacher_ppl", "eval/student_ppl", "eval/attn_error/mean"} <= set(metrics)
    timer = StageTimer()
    with timer("eval"):
        pass
    report.run(ctx, metrics, timer, NullTracker())
    assert "time/eval" in json.loads((ctx.out_dir / "timings.json").read_text())
    assert (ctx.out_dir / "report.md").exists()


def test_a_config_field_no_key_declares_fails_loudly():
    cfg = tiny_config()

    @dataclasses.dataclass
    class TrainWithNewField(type(cfg.train)):
        new_knob: float = 1.0

    changed = dataclasses.replace(cfg, train=TrainWithNewField(**dataclasses.asdict(cfg.train)))
    with pytest.raises(keys.KeyDeclarationError, match="train.new_knob"):
        keys.layer_meta(changed, "k")
    assert keys.layer_meta(cfg, "k")["train"]  # declared fields only: the unchanged config works


def test_every_config_field_feeding_a_key_is_declared():
    cfg = tiny_config()
    for name in keys.IN_KEY:
        declared = set(keys.IN_KEY[name]) | set(keys.OUT_OF_KEY.get(name, ()))
        assert {f.name for f in dataclasses.fields(getattr(cfg, name))} == declared, name


def test_assemble_keeps_the_layer_whose_restoration_lowers_the_kl_most(run, tmp_path):
    import shutil

    from dofla.dof.softmax_layers import kv_bytes_per_token
    from dofla.models import load_student
    from dofla.stages import softmax_layers

    base = run["ctx"]
    cfg = dataclasses.replace(base.cfg, allocation=dataclasses.replace(base.cfg.allocation, softmax_layers=1,
                                                                        softmax_probe_seqs=2))
    ctx = dataclasses.replace(base, cfg=cfg, out_dir=tmp_path / "run")
    shutil.copytree(base.out_dir / "layers", ctx.out_dir / "layers")  # the same trained layers
    assembled = assemble.run(ctx, run["dims"], run["data"].cache_key, run["data"].train_tokens)
    student = assembled.student
    ranking = json.loads((ctx.out_dir / "layers" / softmax_layers.RANKING).read_text())
    chosen = json.loads((ctx.out_dir / softmax_layers.CHOICE).read_text())
    restored = {int(i): kl for i, kl in ranking["measured"]["restored"].items()}
    assert set(restored) == {0, 1} and ranking["measured"]["probe_tokens"] == 2 * cfg.data.seq_len
    assert chosen["layers"] == [min(restored, key=restored.get)] == student.config.dofla["softmax_layers"] \
        == assembled.softmax_layers
    assert [a.mode for a in student.student_attentions()].count("softmax") == 1
    assert student.dofla_settings["softmax_layers"] == {"k": 1, "probe_seqs": 2}
    g = base.geometry
    assert softmax_layers.metrics(student) == {"softmax_layers/count": 1, "softmax_layers/kv_bytes_per_token":
                                               kv_bytes_per_token(1, g.num_kv_heads, g.head_dim)}
    ids = run["data"].heldout_tokens[:1]
    with torch.no_grad():
        saved = load_student(ctx.out_dir / "student")(ids, use_cache=False).logits
        assert torch.equal(saved, student(ids, use_cache=False).logits)
    # assembled again (another k would do the same): the measurement is read, not repeated
    before = (ctx.out_dir / "layers" / softmax_layers.RANKING).stat().st_mtime_ns
    shutil.rmtree(ctx.out_dir / "student")
    again = assemble.run(ctx, run["dims"], run["data"].cache_key, run["data"].train_tokens).student
    assert (ctx.out_dir / "layers" / softmax_layers.RANKING).stat().st_mtime_ns == before
    assert again.config.dofla["softmax_layers"] == chosen["layers"]
    # the proxy ranking (each layer's own attention error) is added to the same file, the KL kept
    by_error = dataclasses.replace(ctx, cfg=dataclasses.replace(cfg, allocation=dataclasses.replace(
        cfg.allocation, softmax_rank="attention_error")))
    proxy = assemble.run(by_error, run["dims"], run["data"].cache_key, run["data"].train_tokens).student
    stored = json.loads((ctx.out_dir / "layers" / softmax_layers.RANKING).read_text())["measured"]
    errors = {int(i): e for i, e in stored["attention_error"].items()}
    assert stored["restored"] == ranking["measured"]["restored"] and set(errors) == {0, 1}
    assert proxy.config.dofla["softmax_layers"] == [max(errors, key=errors.get)]
    assert proxy.dofla_settings["softmax_layers"]["rank"] == "attention_error"
    # the teacher's long-range copying: added to the same file too
    by_copying = dataclasses.replace(ctx, cfg=dataclasses.replace(cfg, allocation=dataclasses.replace(
        cfg.allocation, softmax_rank="retrieval")))
    copier = assemble.run(by_copying, run["dims"], run["data"].cache_key, run["data"].train_tokens).student
    stored = json.loads((ctx.out_dir / "layers" / softmax_layers.RANKING).read_text())["measured"]
    copying = {int(i): c for i, c in stored["retrieval"].items()}
    assert set(copying) == {0, 1} and stored["attention_error"] == {str(i): e for i, e in errors.items()}
    assert copier.config.dofla["softmax_layers"] == [max(copying, key=copying.get)]
    assert softmax_layers.metrics(run["student"]) == {}  # k = 0: nothing restored, nothing reported



def test_assemble_keeps_the_layers_chosen_by_passkey_recall_and_extends_the_choice(run, tmp_path):
    import shutil

    from dofla.stages import softmax_layers

    base = run["ctx"]

    def choose(k):
        cfg = dataclasses.replace(base.cfg, allocation=dataclasses.replace(
            base.cfg.allocation, softmax_layers=k, softmax_probe_seqs=2, softmax_rank="passkey"),
            eval=dataclasses.replace(base.cfg.eval, passkey_lengths=[64, 160]))
        ctx = dataclasses.replace(base, cfg=cfg, out_dir=tmp_path / f"k{k}")
        if not (ctx.out_dir / "layers").exists():
            shutil.copytree(base.out_dir / "layers", ctx.out_dir / "layers")
        student = assemble.run(ctx, run["dims"], run["data"].cache_key, run["data"].train_tokens).student
        return student, json.loads((ctx.out_dir / "layers" / softmax_layers.RANKING).read_text())["measured"]

    student, measured = choose(1)
    passkey = measured["passkey"]
    assert {k: passkey[k] for k in ("length", "prompts", "seed")} == {"length": 160, "prompts": 2,
                                                                      "seed": base.cfg.seed}
    assert len(passkey["greedy"]) == 1 and passkey["greedy"][0]["nll"] <= passkey["base"]
    assert student.config.dofla["softmax_layers"] == [passkey["greedy"][0]["layer"]]
    assert student.dofla_settings["softmax_layers"]["rank"] == "passkey"
    shutil.copytree(tmp_path / "k1" / "layers", tmp_path / "k2" / "layers")  # the stored first step, then k = 2
    stored_path = tmp_path / "k2" / "layers" / softmax_layers.RANKING
    stored = json.loads(stored_path.read_text())
    stored["measured"]["passkey"]["greedy"][0]["nll"] = -1.0  # marked: read back, not measured again
    stored_path.write_text(json.dumps(stored))
    student, measured = choose(2)
    assert measured["passkey"]["greedy"][0] == {**passkey["greedy"][0], "nll": -1.0}
    assert len(measured["passkey"]["greedy"]) == 2
    assert student.config.dofla["softmax_layers"] == [0, 1]
    # a KL ranking on another probe count measures afresh and keeps the passkey choice (its prompts are
    # keyed inside it); the passkey choice then reads it back and keeps the KL measurement in turn
    kl_cfg = dataclasses.replace(base.cfg, allocation=dataclasses.replace(
        base.cfg.allocation, softmax_layers=1, softmax_probe_seqs=1, softmax_rank="kl"))
    assemble.run(dataclasses.replace(base, cfg=kl_cfg, out_dir=tmp_path / "k2"), run["dims"],
                 run["data"].cache_key, run["data"].train_tokens)
    after_kl = json.loads(stored_path.read_text())
    assert after_kl["settings"]["probe_seqs"] == 1 and after_kl["measured"]["probe_tokens"] == base.cfg.data.seq_len
    assert set(after_kl["measured"]["restored"]) == {"0", "1"}
    assert after_kl["measured"]["passkey"] == measured["passkey"]
    shutil.rmtree(tmp_path / "k2" / "student")
    student, again = choose(2)
    assert again == after_kl["measured"] and json.loads(stored_path.read_text())["settings"]["probe_seqs"] == 1
    assert student.config.dofla["softmax_layers"] == [0, 1]

def test_a_sliding_window_student_keeps_exact_the_layer_whose_restoration_lowers_the_kl_most(run, tmp_path):
    """The retrained control of a hybrid with softmax layers: window + sinks elsewhere, nothing linear.
    Its ranking is measured on the windowed student and lives in the run's own layers/."""
    from dofla.models import load_student
    from dofla.stages import softmax_layers

    base = run["ctx"]
    cfg = tiny_config(f"paths.cache_dir={base.cfg.paths.cache_dir}", "attention=sliding_window", "attention.window=4",
                      "attention.sinks=1", "allocation.softmax_layers=1", "allocation.softmax_probe_seqs=2")
    ctx = dataclasses.replace(base, cfg=cfg, out_dir=tmp_path / "sw", plan=tuple(stage_plan(cfg)))
    assert "train" not in ctx.plan and "assemble" in ctx.plan
    dims = [0] * base.geometry.num_layers
    student = assemble.run(ctx, dims, run["data"].cache_key, run["data"].train_tokens).student
    stored = json.loads((ctx.out_dir / "layers" / softmax_layers.RANKING).read_text())
    restored = {int(i): kl for i, kl in stored["measured"]["restored"].items()}
    assert set(restored) == {0, 1} and stored["settings"]["attention"]["name"] == "sliding_window"
    assert all(kl < stored["measured"]["base"] for kl in restored.values())  # exact beats a 4-token window
    chosen = [min(restored, key=restored.get)]
    assert student.config.dofla["softmax_layers"] == chosen
    modes = ["softmax" if i in chosen else "sliding_window" for i in range(2)]
    assert [a.mode for a in student.student_attentions()] == modes
    ids = run["data"].heldout_tokens[:1]
    with torch.no_grad():
        assert torch.equal(load_student(ctx.out_dir / "student")(ids, use_cache=False).logits,
                           student(ids, use_cache=False).logits)


def test_a_hybrid_does_not_reuse_the_linear_students_softmax_ranking():
    """A hybrid trained against full attention shares the linear run's layers; restoring a layer to
    softmax changes its model's KL by another amount, so the stored ranking must not be shared."""
    from dofla.artifacts import canonical

    layers = {"dims": [4, 4]}
    linear = keys.softmax_ranking_settings(tiny_config(), layers)
    assert linear == canonical({"layers": layers, "probe_seqs": 8})  # as before the key had the attention
    assert keys.softmax_ranking_settings(tiny_config("attention.chunk_size=64"), layers) == linear
    hybrid = tiny_config("attention=hybrid", "attention.window=16", "attention.sinks=4", "train.hybrid_target=full")
    gated = tiny_config("attention.gate=scalar")
    others = [keys.softmax_ranking_settings(c, layers) for c in (hybrid, gated)]
    assert linear not in others and others[0] != others[1]
    assert keys.layer_meta(hybrid, "k") == keys.layer_meta(tiny_config(), "k")  # the layers are the same
