"""The fine-tune protocol at scale: micro-batches give the whole batch's gradients (fp64), the run's
precision trains fp32 master weights, a process killed inside the teacher's grid resumes without
redoing a finished trial, and processes started together run each trial of the grid once."""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dofla.eval import task_finetune
from dofla.eval.task_finetune import FinetuneProtocolConfig, finetune_step
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from tests.conftest import write_local_tasks

ROOT = Path(__file__).parents[2]


def rows(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n`` (context, continuation) pairs of uneven lengths (so micro-batches pad differently)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        context, continuation = (int(x) for x in torch.randint(1, 12, (2,), generator=g))
        out.append((torch.randint(1, 250, (context,), generator=g).tolist(),
                    torch.randint(1, 250, (continuation,), generator=g).tolist()))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_micro_batched_steps_land_where_whole_batch_steps_do_in_fp64(family):
    model = build_tiny_model(family, seed=0).double().eval()  # eval: no dropout (it would draw other masks)
    data = rows(7)
    finals = []
    for micro in (None, 1, 3):  # 3: parts of 3, 3 and 1 rows
        work = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(work.parameters(), lr=1e-3, weight_decay=0.0)
        losses = [finetune_step(work, optimizer, data, max_length=16, micro_batch=micro) for _ in range(3)]
        finals.append((torch.stack(losses), torch.cat([p.detach().flatten() for p in work.parameters()])))
    (loss, params), moved = finals[0], (finals[0][1] - torch.cat([p.flatten() for p in model.parameters()]))
    assert moved.abs().max() > 1e-4  # the steps did train
    for other_loss, other_params in finals[1:]:
        torch.testing.assert_close(other_loss, loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(other_params, params, rtol=1e-10, atol=1e-12)


def test_the_step_loss_is_the_models_own_mean_next_token_loss():
    model = build_tiny_model("llama", seed=0).double()
    data = rows(5, seed=1)
    input_ids, labels = task_finetune.pad_batch(data, 16)
    want = model(input_ids=input_ids, labels=labels, use_cache=False).loss
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    got = finetune_step(model, optimizer, data, 16, micro_batch=2)
    torch.testing.assert_close(got, want.detach().double(), rtol=1e-6, atol=1e-7)  # transformers': fp32


def test_under_bf16_the_forwards_autocast_and_the_weights_stay_fp32():
    model = convert(build_tiny_model("llama", seed=0), feature_map="learned_prf")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = finetune_step(model, optimizer, rows(4), 16, micro_batch=2, precision="bf16")
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_micro_batched_protocol_scores_what_the_whole_batch_scores(tmp_path, byte_tokenizer):
    tasks = write_local_tasks(tmp_path)
    teacher = build_tiny_model("llama", seed=0).double()
    pairs = task_finetune.training_pairs("piqa_local", teacher, byte_tokenizer, (str(tasks),), 12)
    scores = []
    for micro in (None, 1):
        cfg = FinetuneProtocolConfig(epochs=2, batch_size=4, eval_limit=6, task_dirs=(str(tasks),),
                                     micro_batch_size=micro, log_every=2)
        scores.append(task_finetune.finetune_and_score(teacher, byte_tokenizer, "piqa_local", pairs, 3e-3, cfg))
    whole, micro = scores
    assert whole.steps == micro.steps == 6  # 12 examples, batch 4, 2 epochs
    assert micro.epoch_accs == whole.epoch_accs and micro.acc == whole.acc


class Crash(RuntimeError):
    pass


def old_layout(saved: dict, per_epoch: int) -> dict:
    """A mid-epoch trial checkpoint in the layout the trials wrote before they ran on the loop harness."""
    data, (epoch, step) = saved["data"], divmod(saved["data"]["steps"], per_epoch)
    progress = {"epoch": epoch, "step": step, "order": data["order"], "trained": False, "accs": data["accs"],
                "losses": data["losses"], "current": data["current"], "steps": data["steps"],
                "seconds": saved["state"]["seconds"]}
    return {"model": saved["modules"]["model"], "optimizer": saved["optimizers"]["model"], "progress": progress,
            "generator": data["generator"], "rng": saved["rng"], "meta": saved["meta"]}


def test_a_trial_resumes_from_its_checkpoint_and_from_one_in_the_layout_before_the_loop(tmp_path, byte_tokenizer,
                                                                                       monkeypatch, capsys):
    from dofla.eval.finetune_store import TrialStore
    from dofla.train import loop

    tasks = write_local_tasks(tmp_path)
    teacher = build_tiny_model("llama", seed=0)
    pairs = task_finetune.training_pairs("piqa_local", teacher, byte_tokenizer, (str(tasks),), 12)
    cfg = FinetuneProtocolConfig(epochs=2, batch_size=4, eval_limit=6, task_dirs=(str(tasks),), checkpoint_every=1)
    run = lambda store: task_finetune.finetune_and_score(teacher, byte_tokenizer, "piqa_local", pairs, 3e-3, cfg,  # noqa: E731
                                                         store)
    reference = run(None)
    second_epoch = re.findall(r"epoch 2/2: loss (\S+)", capsys.readouterr().out)  # its mean training loss
    store = TrialStore(tmp_path / "trials", {"run": "a"})

    def crash_at(point):
        if point == "finetune:model:piqa_local:lr0.003:step4":  # the second epoch's second step
            raise Crash

    with monkeypatch.context() as patched:
        patched.setattr(loop, "kill_point", crash_at)
        with pytest.raises(Crash):
            run(store)
    saved = torch.load(store.checkpoint_path("piqa_local", 3e-3), weights_only=False)
    assert saved["state"]["step"] == 4 and len(saved["data"]["accs"]) == 1  # the first epoch scored
    legacy = TrialStore(tmp_path / "legacy", {"run": "a"})
    legacy.checkpoint_path("piqa_local", 3e-3).parent.mkdir(parents=True)
    torch.save(old_layout(saved, per_epoch=3), legacy.checkpoint_path("piqa_local", 3e-3))
    capsys.readouterr()
    for kept in (store, legacy):
        resumed = run(kept)
        assert resumed.steps == reference.steps == 6 and resumed.epoch_accs == reference.epoch_accs
        assert resumed.acc == reference.acc and resumed.chosen_epoch == reference.chosen_epoch
        log = capsys.readouterr().out
        assert "resumed at step 4 (epoch 2, step 1 of it)" in log
        assert re.findall(r"epoch 2/2: loss (\S+)", log) == second_epoch  # the same steps on the same batches


def worker(root: Path, name: str, kill_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "DOFLA_KILL_AT"}
    env["TQDM_DISABLE"] = "1"
    if kill_at:
        env["DOFLA_KILL_AT"] = kill_at
    return subprocess.Popen([sys.executable, "-m", "tests.component.finetune_worker", str(root), name], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    out, _ = process.communicate(timeout=600)
    return process.returncode, out


def trials_run(log: str, who: str = "teacher") -> list[str]:
    """The learning rates whose trials this log's process finished itself."""
    return re.findall(rf"fine-tune protocol: {who} on piqa_local at lr (\S+) done", log)


def shared_root(root: Path) -> Path:
    (root / "tasks").mkdir()
    write_local_tasks(root / "tasks")
    return root


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = shared_root(tmp_path_factory.mktemp("uninterrupted"))
    code, log = finish(worker(root, "run"))
    assert code == 0, log[-3000:]
    assert trials_run(log) == ["0.0001", "0.001"] and len(trials_run(log, "student")) == 1
    return json.loads((root / "run" / "metrics.json").read_text())


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "finetuned/step_s"}


def test_a_process_killed_inside_the_teachers_grid_resumes_without_redoing_a_trial(tmp_path, uninterrupted):
    root = shared_root(tmp_path)
    code, log = finish(worker(root, "run", kill_at="finetune:teacher:piqa_local:lr0.001:step2"))
    assert code == -signal.SIGKILL, log[-3000:]
    assert trials_run(log) == ["0.0001"]  # the first rate finished, the second was killed at its third step
    code, log = finish(worker(root, "run"))
    assert code == 0, log[-3000:]
    assert trials_run(log) == ["0.001"]  # the finished rate is read, not run again
    assert "teacher on piqa_local at lr 0.001 resumed at step 2" in log
    assert without_timing(json.loads((root / "run" / "metrics.json").read_text())) == without_timing(uninterrupted)


def test_two_processes_started_together_run_each_trial_of_the_grid_once(tmp_path, uninterrupted):
    root = shared_root(tmp_path)
    processes = [worker(root, name) for name in ("cell_a", "cell_b")]
    results = [finish(p) for p in processes]
    for code, log in results:
        assert code == 0, log[-3000:]
    assert sorted(lr for _, log in results for lr in trials_run(log)) == ["0.0001", "0.001"]
    for name in ("cell_a", "cell_b"):  # each cell fine-tunes its own student, with the shared grid's rate
        assert without_timing(json.loads((root / name / "metrics.json").read_text())) == without_timing(uninterrupted)
