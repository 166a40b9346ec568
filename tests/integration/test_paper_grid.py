"""`dofla -m experiment=paper_grid_smollm2` on the real embedded model, shrunk to minutes (slow)."""
from __future__ import annotations

import csv
import json

import pytest

from tests.integration.test_pipeline import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.grid]  # not in the default run: `pytest -m grid`

CELLS = {f"{p}_{loss}" for p in ("fix", "dof", "dof_clip", "dof_head") for loss in ("direct", "softmax", "l2")}
CELLS |= {"performer", "dijiang"}


def _variant(run_dir) -> str:
    overrides = json.loads((run_dir / "run.json").read_text())["overrides"]
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("+variant="))


def test_paper_grid_smollm2_at_a_very_small_size(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "experiment=paper_grid_smollm2", f"hydra.sweep.dir={sweep}",
                     f"paths.cache_dir={tmp_path / 'cache'}",
                     "data.seq_len=128", "data.num_tokens=512", "data.heldout_tokens=256",
                     "train.steps=2", "train.eval_every=1", "allocation.num_samples=64",
                     "eval.tasks=[]", "eval.attn_error_seqs=1", timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {_variant(p.parent): p.parent for p in sweep.rglob("metrics.json")}
    assert set(runs) == CELLS
    for name, run in runs.items():
        metrics = json.loads((run / "metrics.json").read_text())
        dims = json.loads((run / "allocation.json").read_text())["dims"]
        assert metrics["eval/student_ppl"] > 0 and len(dims) == 30
        if "dof_clip" in name:  # clipped at the head size: never above 64, never dearer than fix
            assert max(dims) <= 64 and sum(dims) <= 30 * 64
        elif "dof_head" in name:  # per-head dims, multiples of 8, mean ≈ C
            assert all(len(layer) == 9 and all(m % 8 == 0 for m in layer) for layer in dims)
            assert abs(sum(map(sum, dims)) / (30 * 9) - 64) < 8
        else:  # fix, dof and the baselines spend the budget C = 64 per layer (dof: up to rounding)
            assert abs(sum(dims) / 30 - 64) < 1
    # one activation cache for all fourteen runs, one report comparing them
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    rows = list(csv.DictReader(open(sweep / "report.csv")))
    assert len(rows) == 14
    assert (sweep / "gap_closed.png").exists() and (sweep / "perplexity.png").exists()
