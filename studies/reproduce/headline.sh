#!/usr/bin/env bash
# Reproduces docs/results/headline.md from a clean checkout: each headline preset over three data orders
# (seed=0,1,2 also set the order of the training text), then the page's run records and tables.
# About 15 hours on 2 CPU cores. EXTRA: more overrides for every run (e.g. to stop before the eval).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/headline}
for seed in 0 1 2; do
  for preset in hybrid_recall window_sinks_kl linear_hedgehog_kl hybrid_text linear_delta_kl hybrid_delta; do
    # train.layer_dir: the Hedgehog layerwise stage of an order, trained once, read by the linear and hybrid presets
    dofla experiment=$preset seed=$seed train.layer_dir=$OUT/layers ${EXTRA:-} hydra.run.dir=$OUT/${preset}_s$seed
  done
done
python -m studies.records $OUT --into docs/results/runs/headline
python -m studies.results headline
