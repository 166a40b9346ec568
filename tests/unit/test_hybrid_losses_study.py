"""studies/hybrid_losses.py: per-layer attention error of hybrid layers trained with each loss."""
from __future__ import annotations

import pytest
import torch

from studies.hybrid_losses import attention_error, expand, main
from dofla.cache import build_or_load_cache
from dofla.eval.metrics import layer_attention_error
from dofla.feature_maps import build_feature_map
from dofla.models.tiny import build_tiny_model


def _qkv(seqs=3, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(seqs, 4, t, 16, generator=g), torch.randn(seqs, 2, t, 16, generator=g), torch.randn(seqs, 2, t, 16, generator=g)


def test_attention_error_references():
    q, k, v = _qkv()
    fm = build_feature_map("learned_prf", 4, 16, 8)
    ke, ve = expand(k, 4), expand(v, 4)
    # a window that covers every key is exact softmax: no error, with or without the linear part
    assert attention_error(fm, q, ke, ve, window=24, sinks=0) < 1e-6
    assert attention_error(fm, q, ke, ve, window=24, sinks=0, ablate=True) < 1e-6
    # the ablation removes the linear part: a narrow window alone differs from window + linear
    assert attention_error(fm, q, ke, ve, 4, 1, ablate=True) != pytest.approx(attention_error(fm, q, ke, ve, 4, 1))
    # window 0 is pure linear attention, as the evaluation's per-layer error measures it
    assert attention_error(fm, q, ke, ve, 0, 0) == pytest.approx(layer_attention_error(fm, q, k, v), rel=1e-4)


def test_main_writes_a_table_per_layer(tmp_path, capsys):
    model = build_tiny_model("llama", seed=0, num_layers=2)
    tokens = torch.randint(0, 200, (5, 32), generator=torch.Generator().manual_seed(0))
    cache = build_or_load_cache(model, tokens, {"test": "hybrid_losses"}, tmp_path, progress=False)
    out = tmp_path / "table.md"
    main(["--cache", str(cache.path), "--layers", "0,1", "--losses", "output,softmax", "--window", "8",
          "--sinks", "1", "--features", "8", "--steps", "6", "--out", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2 and all(row.count("**") == 2 for row in rows)  # one best loss per layer
    assert "| layer | ablated | output | softmax |" in text and "window 8 + 1 sinks" in text
    with pytest.raises(SystemExit):
        main(["--cache", str(cache.path), "--losses", "kl"])
