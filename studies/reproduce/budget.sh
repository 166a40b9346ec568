#!/usr/bin/env bash
# Reproduces the allocated students of docs/results/budget.md from a clean checkout: experiment=budget_tenth
# (every KV head of the embedded SmolLM2 picks exact, a 64-token window with 4 sinks, or that window with a
# gated-delta state of M = 64 by measured KL and passkey gains, the knapsack solved exactly under the budget)
# at each share of the teacher's KV cache at 8,192 tokens in SHARES and each data order in SEEDS, trained and
# scored as the headline students are, then the page. Each finished run's record goes to
# docs/results/runs/budget_test/ (or budget/ with SPLIT=dev) as soon as the run ends; running the script
# again skips nothing it has not finished (every stage's artifact is found and reused).
# SHARES, SEEDS: a subset or more (e.g. SHARES="0.05 0.1 0.25" SEEDS="0 1 2"); EXTRA: more overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/budget}
# SPLIT: the part of the held-out text each run scores (dofla.data.split); test by default, as headline.sh.
SPLIT=${SPLIT:-test}
case $SPLIT in
  test) SCORE="data.heldout_split=test eval.long_context_seqs=15" SUFFIX=_test ;;
  dev) SCORE="" SUFFIX="" ;;
  *) echo "SPLIT=$SPLIT must be test or dev" >&2; exit 2 ;;
esac
RECORDS=${RECORDS:-docs/results/runs/budget$SUFFIX}
SEEDS=${SEEDS:-0}
SHARES=${SHARES:-0.1}
for seed in $SEEDS; do
  for share in $SHARES; do
    dofla experiment=budget_tenth budget.share=$share seed=$seed $SCORE ${EXTRA:-} \
      hydra.run.dir=$OUT/share${share}_s$seed
    python -m studies.records $OUT/share${share}_s$seed --into $RECORDS
  done
done
