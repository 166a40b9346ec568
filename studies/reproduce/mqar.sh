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
# SPLIT: the part of the held-out text each run scores (dofla.data.split). test (the default): the held-out
# tokens after the first 65,536, which no record before the split scored: all of them in sequences of 512 (63)
# and 15 sequences of 2,048 for the loss by position. dev: the first 65,536, as the records in
# docs/results/runs/<page>/ were scored. The split is in no trained artifact's key, so a run directory a dev
# run finished is re-scored on test, not trained again; test records go to docs/results/runs/<page>_test/.
SPLIT=${SPLIT:-test}
case $SPLIT in
  test) SCORE="data.heldout_split=test eval.long_context_seqs=15" SUFFIX=_test ;;
  dev) SCORE="" SUFFIX="" ;;
  *) echo "SPLIT=$SPLIT must be test or dev" >&2; exit 2 ;;
esac
for seed in $SEEDS; do
  for preset in $PRESETS; do
    dofla experiment=$preset seed=$seed train.layer_dir=$OUT/layers eval.mqar=true $SCORE \
      'eval.mqar_seq_lens=[64,128,256,512]' hydra.run.dir=$OUT/${preset}_mqar_s$seed
    python -m studies.records $OUT/${preset}_mqar_s$seed --into docs/results/runs/mqar$SUFFIX
  done
done
python -m studies.results mqar
