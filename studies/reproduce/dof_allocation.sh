#!/usr/bin/env bash
# Reproduces docs/results/dof_allocation.md's answer from a clean checkout: the best pure linear additive
# student (linear_hedgehog_kl, `fix`) against the same preset with its feature budget shared by each
# layer's degrees of freedom (`allocation=dof`), over three data orders. seed=0,1,2 also set the order of
# the layerwise and KL text, so each order trains its own layerwise stage under each policy. The `fix` arm
# is the headline preset's own run (the same command and run directory as studies/reproduce/headline.sh,
# so a run either script finished is resumed, not repeated, and its record stays with the headline's); the
# `dof` arm skips passkey (no pure linear student recalls one). Then the page's tables.
# 6 runs, about 20 min each on 2 CPU cores. SEEDS: a subset (e.g. SEEDS=0).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-multirun_sweeps/headline}
SEEDS=${SEEDS:-0 1 2}
for seed in $SEEDS; do
  dofla experiment=linear_hedgehog_kl seed=$seed train.layer_dir=$OUT/layers hydra.run.dir=$OUT/linear_hedgehog_kl_s$seed
  python -m studies.records $OUT/linear_hedgehog_kl_s$seed --into docs/results/runs/headline
  dofla experiment=linear_hedgehog_kl allocation=dof seed=$seed train.layer_dir=$OUT/layers \
    'eval.passkey_lengths=[]' hydra.run.dir=$OUT/linear_hedgehog_kl_dof_s$seed
  python -m studies.records $OUT/linear_hedgehog_kl_dof_s$seed --into docs/results/runs/dof_allocation
done
python -m studies.results dof_allocation
