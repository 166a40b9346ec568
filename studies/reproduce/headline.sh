#!/usr/bin/env bash
# Reproduces docs/results/headline.md from a clean checkout: each headline preset over three data orders
# (seed=0,1,2 also set the order of the training text), then the page's tables. Each finished run's
# record goes to docs/results/runs/headline/ as soon as the run ends, so a stopped script keeps what it
# finished, and running it again resumes the unfinished run and skips the finished ones.
# 21 runs (hybrid_copy: the recall hybrid's copy-text control). On 2 CPU cores one run of linear_hedgehog_kl took 23 min and one of hybrid_text 17 min (its
# order's layers already trained); the recall hybrid took 2 h 38 min before the KL stage's speed-up
# (evaluation 100 min of it, with the teacher's scores, which the later runs reuse). SEEDS, PRESETS: a subset (e.g. SEEDS=0 PRESETS="window_sinks_kl");
# EXTRA: more overrides for every run (e.g. to stop before the eval).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/headline}
source studies/reproduce/split.sh  # SPLIT=test (default) or dev: SCORE, SUFFIX
RECORDS=${RECORDS:-docs/results/runs/headline$SUFFIX}
SEEDS=${SEEDS:-0 1 2}
PRESETS=${PRESETS:-hybrid_recall hybrid_copy window_sinks_kl linear_hedgehog_kl hybrid_text linear_delta_kl hybrid_delta}
for seed in $SEEDS; do
  for preset in $PRESETS; do
    # train.layer_dir: the Hedgehog layerwise stage of an order, trained once, read by the linear and hybrid presets
    dofla experiment=$preset seed=$seed train.layer_dir=$OUT/layers $SCORE ${EXTRA:-} hydra.run.dir=$OUT/${preset}_s$seed
    python -m studies.records $OUT/${preset}_s$seed --into $RECORDS
  done
done
python -m studies.results headline
