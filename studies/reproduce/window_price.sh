#!/usr/bin/env bash
# Reproduces the window-price table of docs/results/budget.md: a budget of studies/reproduce/budget.sh solved again
# on the menu its trained run measured (put back from that run's record, so nothing is measured but the chosen
# plan), now that a plain window holds each KV head's keys once and costs a third of what that run counted.
# The allocate stage alone (about 6 min on 2 CPU cores: the chosen plan's check); records in
# docs/results/runs/budget_alloc/window_price_share<share>_s<seed>/. SHARES, SEEDS: as budget.sh's.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/budget}
SEEDS=${SEEDS:-0}
SHARES=${SHARES:-0.1}
for seed in $SEEDS; do
  for share in $SHARES; do
    python -m studies.budget_menu docs/results/runs/budget/share${share}_s$seed/allocation.json
    run=$OUT/window_price_share${share}_s$seed
    dofla experiment=budget_tenth budget.share=$share seed=$seed 'stages=[cache,allocate]' hydra.run.dir=$run
    python -m studies.records $run --allocation-only --into docs/results/runs/budget_alloc
  done
done
python -m studies.results budget
