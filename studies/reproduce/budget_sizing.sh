#!/usr/bin/env bash
# Reproduces the state-sizing comparison on docs/results/budget.md: at a tenth of the teacher's decode memory,
# a menu of four state sizes (exact; a 64-token window with 4 sinks, bare or with a gated-delta state of
# M = 32, 64, 128 or 256), its values estimated once (ESTIMATOR, default first_order: one backward of the
# baseline student per data order; measured: every option run as a student, about 2.5x the three-option menu's
# 43 min here), then solved with each rule for sizing the states (budget.state_sizing: measured, dof, uniform),
# each plan measured on the calibration text. Allocation only, nothing trained: records in
# docs/results/runs/budget_alloc/. The dof rule runs the dof stage (Algorithm 1, the project's variant) first.
# SIZINGS, SEEDS, SHARE: e.g. SEEDS="0 1" or SIZINGS=dof.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/budget_alloc}
SEEDS=${SEEDS:-0}
SHARE=${SHARE:-0.1}
ESTIMATOR=${ESTIMATOR:-first_order}
for seed in $SEEDS; do
  for sizing in ${SIZINGS:-measured dof uniform}; do
    run=$OUT/sizing_${ESTIMATOR}_${sizing}_share${SHARE}_s$seed
    dofla experiment=budget_tenth seed=$seed budget.share=$SHARE 'budget.states=[32,64,128,256]' \
      budget.estimator=$ESTIMATOR budget.state_sizing=$sizing 'stages=[cache,allocate]' hydra.run.dir=$run
    python -m studies.records $run --allocation-only --into docs/results/runs/budget_alloc
  done
done
