#!/usr/bin/env bash
# Reproduces the thread-count check on docs/results/headline.md ("Does a run move with the thread count?"):
# the default run (`dofla`, the lm-eval tasks left out) from scratch with one seed, once on each thread
# count (OMP_NUM_THREADS and MKL_NUM_THREADS), each with a cache directory of its own so every stage runs
# again: the teacher's conversion, the data, the activation cache, Algorithm 1, the training and the scoring.
# About 10 min for both on 2 CPU cores. THREADS, SEED: e.g. THREADS="1 2 4" SEED=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/threads}
SEED=${SEED:-0}
for t in ${THREADS:-1 2}; do
  run=$OUT/t${t}_s$SEED
  DOFLA_CACHE_DIR=$OUT/cache_t$t OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t dofla seed=$SEED 'eval.tasks=[]' hydra.run.dir=$run
  python -m studies.records $run --into docs/results/runs/threads
done
python -m studies.results threads
