#!/usr/bin/env bash
# A quality grid like docs/results/embedded_sweeps.md's, as one command:
# every feature map × layerwise loss × allocation at the paper's budget, end-to-end (`direct`)
# training, hybrid attention and LoRA, all into one sweep directory, then one report.
#
#   bash studies/quality.sh [SWEEP_DIR] [extra overrides for every run...]
#
# On this project's 2-core CPU machine the whole table takes 6–9 hours (softmax cells ~7 min,
# l2 25–50 min, direct ~17 min each). `bash studies/quality.sh /tmp/q experiment=smoke_tiny` runs
# every cell on a tiny random model in about 3.5 min.
# Run it again after a kill and it resumes: each cell reuses the stages it finished.
set -euo pipefail
S=${1:-multirun_sweeps/quality}
shift || true
EXTRA=("$@")
O='hydra.sweep.subdir=${hydra.job.override_dirname}'

sweep() { dofla -m "$@" 'eval.tasks=[]' "$O" "hydra.sweep.dir=$S" "${EXTRA[@]}"; }

sweep feature_map=learned_prf,hedgehog,dijiang,elu1 loss=softmax,l2 allocation=fix,dof
sweep feature_map=performer allocation=fix,dof            # untrained: the loss does not matter
sweep loss=direct allocation=fix,dof
sweep attention=hybrid feature_map=learned_prf,hedgehog allocation=fix,dof
dofla attention=hybrid allocation=dof finetune=lora 'eval.tasks=[]' "hydra.run.dir=$S/lora_hybrid_dof" "${EXTRA[@]}"
dofla-report "$S"
