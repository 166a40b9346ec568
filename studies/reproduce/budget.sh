#!/usr/bin/env bash
# Reproduces the allocated students of docs/results/budget.md from a clean checkout: experiment=budget_tenth
# (every KV head of the embedded SmolLM2 picks exact, a 64-token window with 4 sinks, or that window with a
# gated-delta state of M = 64 by measured KL and passkey gains, the knapsack solved exactly under the budget)
# at each share of the teacher's KV cache at 8,192 tokens in SHARES and each data order in SEEDS, trained as
# the headline students are. Every run is scored twice from the same trained student: on the test split with
# the generation-scored agreement (records in docs/results/runs/budget_test/) and on the dev split, where the
# headline's uniform presets were scored (records in docs/results/runs/budget/), so the page pairs them.
# The menu is measured once per data order (its calibration text is the order's first training sequences)
# and every other share solves on it (dofla: allocation=budget: solved on the menu measured before).
# Beside each order's first share, the same allocation with budget.estimator=first_order (the allocate stage
# alone; records in docs/results/runs/budget_alloc/), which the page sets against the measured menu.
# A stopped script resumes: every finished stage's artifact is found and reused.
# SHARES, SEEDS: a subset or more (e.g. SHARES="0.05 0.1 0.25" SEEDS="0 1 2"); SPLITS: the held-out parts to
# score on (default "test dev"); EXTRA: more overrides;
# FIRST_ORDER=0 skips the first-order allocation (e.g. when adding shares to an order that has it).
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/reproduce/split.sh  # TEST_SCORE, score_on_splits
OUT=${OUT:-multirun_sweeps/budget}
SEEDS=${SEEDS:-0}
SHARES=${SHARES:-0.1}
for seed in $SEEDS; do
  for share in $SHARES; do
    run=$OUT/share${share}_s$seed
    common=(experiment=budget_tenth budget.share=$share seed=$seed ${EXTRA:-} hydra.run.dir=$run)
    score_on_splits $run docs/results/runs/budget_test docs/results/runs/budget "${common[@]}"
  done
  [ "${FIRST_ORDER:-1}" = 0 ] && continue
  share=${SHARES%% *}
  dofla experiment=budget_tenth budget.share=$share seed=$seed budget.estimator=first_order 'stages=[cache,allocate]' \
    ${EXTRA:-} hydra.run.dir=$OUT/first_order_share${share}_s$seed
  python -m studies.records $OUT/first_order_share${share}_s$seed --allocation-only --into docs/results/runs/budget_alloc
done
python -m studies.results budget
