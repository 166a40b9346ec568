#!/usr/bin/env bash
# Reproduces the ablations of docs/results/budget.md ("What each part of the allocator adds"): the allocated
# student of experiment=budget_tenth (a tenth of the teacher's KV cache at 8,192 tokens) with one part changed,
# trained and scored as budget.sh trains and scores its students (on test, then on dev; records in
# docs/results/runs/budget_ablations_test/ and budget_ablations/). The page pairs each with the allocated
# student of the same budget and data order (run budget.sh first), and the unchanged allocator at a uniform
# preset's measured decode bytes with that preset (dev, the headline's records).
#   layer      budget.granularity=layer: a layer's KV heads take one option (its own menu: one measurement)
#   kl         budget.retrieval_weight=0: the KL gain alone chooses (solved on the measured menu)
#   retrieval  budget.kl_weight=0: the passkey-answer gain alone chooses (solved on the measured menu)
#   kl100      budget.kl_weight=100: both gains choose, a nat of KL per token worth 100 nats per passkey prompt
#              (where neither signal's summed gain falls below ~0.9 of its best; the page's weights table)
#   random     budget.solver=random: a random plan at the budget's bytes
#   delta      the allocator at hybrid_delta's 17.60 MiB          recall  at hybrid_recall's 86.08 MiB
#   copy       the same plan, its KL stage on the recall hybrid's text (a quarter copy tasks, distance 128)
#   copying    budget.copy_weight=1: the teacher's copying score of each head kept exact adds to its value
#   price      the allocator unchanged, solved at a window's current price (each KV head's keys held once; the
#              records above priced a window per query head, three times as much)   price_quarter  the same at 0.25
#   windows    budget.windows=[64,256]: a 256-token window (with sinks, with and without the state) on the
#              menu too, at the current price; the options of the order's menu measured before are taken over
#              (a window must be shorter than the calibration's 512-token sequences: 1,024 needs longer ones)
# ABLATIONS, SEEDS: a subset or more (e.g. ABLATIONS="kl retrieval" SEEDS="0 1"); SPLITS: the held-out parts
# to score on (default "test dev"; "test" alone pairs every ablation but delta and recall); EXTRA: more overrides.
# A stopped script resumes: every finished stage's artifact is found and reused. MENU_FROM_RECORDS=1 first puts
# the committed order-0 measured menu back in the cache (studies/budget_menu.py): the ablations that solve on it
# then skip budget.sh's menu measurement (about 43 min here).
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/reproduce/split.sh  # TEST_SCORE, score_on_splits
[ "${MENU_FROM_RECORDS:-0}" = 1 ] && python -m studies.budget_menu docs/results/runs/budget/share0.1_s0/allocation.json
OUT=${OUT:-multirun_sweeps/budget_ablations}
SEEDS=${SEEDS:-0}
for seed in $SEEDS; do
  for ablation in ${ABLATIONS:-copy kl retrieval kl100 random layer delta recall copying price price_quarter windows}; do
    case $ablation in
      layer) change=(budget.granularity=layer) ;;
      kl) change=(budget.retrieval_weight=0) ;;
      retrieval) change=(budget.kl_weight=0) ;;
      kl100) change=(budget.kl_weight=100) ;;
      random) change=(budget.solver=random) ;;
      delta) change=(budget.share=null budget.mib=17.6039) ;;
      recall) change=(budget.share=null budget.mib=86.0831) ;;
      copy) change=(distill.copy_share=0.25 distill.copy_distance=128) ;;
      copying) change=(budget.copy_weight=1) ;;
      price) change=() ;;
      price_quarter) change=(budget.share=0.25) ;;
      windows) change=('budget.windows=[64,256]') ;;
      *) echo "budget_ablations.sh: unknown ablation '$ablation' (layer, kl, retrieval, kl100, random, delta, recall, copy," \
              "copying, price, price_quarter, windows)" >&2
         exit 2 ;;
    esac
    run=$OUT/${ablation}_s$seed
    common=(experiment=budget_tenth seed=$seed "${change[@]}" ${EXTRA:-} hydra.run.dir=$run)
    score_on_splits $run docs/results/runs/budget_ablations_test docs/results/runs/budget_ablations "${common[@]}"
  done
done
python -m studies.results budget
