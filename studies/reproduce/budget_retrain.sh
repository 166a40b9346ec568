#!/usr/bin/env bash
# Reproduces docs/results/budget.md's "The recorded plan trained again": the plan an allocated run chose
# (its record's allocation.json), given whole (attention.plan) and trained and scored on test as
# experiment=budget_tenth trains and scores it, in the run's data order (records in
# docs/results/runs/budget_retrained_test/). Set against the recorded run, it shows what the code and the
# training move with the plan held fixed. RUNS: records of docs/results/runs/budget_test/ (default share0.1_s0).
# A stopped script resumes: every finished stage's artifact is found and reused.
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/reproduce/split.sh  # TEST_SCORE
OUT=${OUT:-multirun_sweeps/budget_retrained}
for name in ${RUNS:-share0.1_s0}; do
  seed=${name##*_s}
  python -m studies.budget_retrained docs/results/runs/budget_test/$name/allocation.json $OUT/$name.plan.json
  dofla experiment=headline_common loss=output attention.plan=$OUT/$name.plan.json seed=$seed \
    'eval.passkey_lengths=[1024,2048]' eval.mqar=true 'eval.mqar_seq_lens=[64,128,256,512]' $TEST_SCORE \
    ${EXTRA:-} hydra.run.dir=$OUT/$name
  python -m studies.records $OUT/$name --into docs/results/runs/budget_retrained_test
done
python -m studies.results budget
