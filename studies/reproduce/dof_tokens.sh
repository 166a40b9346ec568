#!/usr/bin/env bash
# Reproduces the tokens study on docs/results/dof_allocation.md and docs/results/headline.md: the pure
# linear students trained on more KL text (distill.tokens, 4x the headline's 65,536 by default), each
# preset under each policy, each data order. Every run is scored twice from the same trained student: on
# the test split (records in docs/results/runs/dof_tokens_test/) and on the dev split, where the
# 65,536-token records of docs/results/runs/headline/ and dof_allocation/ were scored, so the tokens curve
# compares like with like (records in docs/results/runs/dof_tokens/). The split is in no trained
# artifact's key: the second scoring reads the trained student and only evaluates. The test scoring adds the
# generation-scored agreement with the teacher (64 held-out prompts of 64 tokens, 32 greedy tokens each).
# About an hour per policy and order at 262,144 tokens on 2 CPU cores (measured for fix, order 0, while other
# work shared the cores: layerwise 12 min, KL 44 min at 100 tokens/s, test scoring 4 min, dev scoring 8 min).
# TOKENS, SEEDS, PRESETS, POLICIES: e.g. SEEDS="1 2" or PRESETS=linear_hedgehog_kl POLICIES=fix. The KJV
# training split holds 899,912 tokens; after the layerwise stage's 73,728, a KL stage asked for more than
# the remaining 826,184 stops there with a warning and records the tokens it used, unless PASSES=2
# (distill.passes): then it reads its text again in another order, e.g. TOKENS=1048576 PASSES=2 SEEDS=0.
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/reproduce/split.sh  # TEST_SCORE
OUT=${OUT:-multirun_sweeps/dof_tokens}
TOKENS=${TOKENS:-262144}
SEEDS=${SEEDS:-0 1 2}
PRESETS=${PRESETS:-linear_delta_kl}
POLICIES=${POLICIES:-fix dof}
for seed in $SEEDS; do
  for preset in $PRESETS; do
    for policy in $POLICIES; do
      run=$OUT/${preset}_${policy}_t${TOKENS}_s$seed
      common=(experiment=$preset allocation=$policy seed=$seed distill.tokens=$TOKENS distill.passes=${PASSES:-1}
              train.layer_dir=$OUT/layers
              'eval.passkey_lengths=[]' hydra.run.dir=$run)
      dofla "${common[@]}" $TEST_SCORE
      python -m studies.records $run --into docs/results/runs/dof_tokens_test
      dofla "${common[@]}"
      python -m studies.records $run --into docs/results/runs/dof_tokens
    done
  done
done
