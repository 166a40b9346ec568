#!/usr/bin/env bash
# Reproduces docs/results/headline.md's MQAR table: the two pure linear presets (gated delta rule and
# additive Hedgehog) of data order 0, trained as the headline trains them, with the MQAR probe added to
# their eval (16 examples at T = 64, 128, 256, 512; seed 0 sets the examples, the same for every model).
# The runs are the headline's own command plus eval.mqar, so their held-out scores repeat the headline
# records'. About 30 min per preset on 2 CPU cores. SEEDS, PRESETS: a subset or more.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/headline}
SEEDS=${SEEDS:-0}
PRESETS=${PRESETS:-linear_delta_kl linear_hedgehog_kl}
source studies/reproduce/split.sh  # SPLIT=test (default) or dev: SCORE, SUFFIX
for seed in $SEEDS; do
  for preset in $PRESETS; do
    dofla experiment=$preset seed=$seed train.layer_dir=$OUT/layers eval.mqar=true $SCORE \
      'eval.mqar_seq_lens=[64,128,256,512]' hydra.run.dir=$OUT/${preset}_mqar_s$seed
    python -m studies.records $OUT/${preset}_mqar_s$seed --into docs/results/runs/mqar$SUFFIX
  done
done
python -m studies.results mqar
