# Sourced by the reproduction scripts once they are in the repository's root: the part of the held-out text
# each run scores (dofla.data.split). SPLIT=test (the default): the held-out tokens after the first 65,536,
# which no record before the split scored: all of them in sequences of 512 (63) and 15 sequences of 2,048 for
# the loss by position, with the generation-scored agreement with the teacher (64 held-out prompts of 64
# tokens, 32 greedy tokens each). SPLIT=dev: the first 65,536, as the records in docs/results/runs/<page>/
# were scored. The split is in no trained artifact's key, so a run directory a dev run finished is re-scored
# on test, not trained again; test records go to docs/results/runs/<page>_test/.
# Sets TEST_SCORE (the overrides that score on test), SCORE (SPLIT's) and SUFFIX (its records' folder suffix),
# and defines score_on_splits.
TEST_SCORE="data.heldout_split=test eval.long_context_seqs=15 eval.agreement_prompts=64"
SPLIT=${SPLIT:-test}
case $SPLIT in
  test) SCORE=$TEST_SCORE SUFFIX=_test ;;
  dev) SCORE="" SUFFIX="" ;;
  *) echo "SPLIT=$SPLIT must be test or dev" >&2; exit 2 ;;
esac

# score_on_splits RUN TEST_RECORDS DEV_RECORDS DOFLA_ARGS...: the run of DOFLA_ARGS (hydra.run.dir=RUN among
# them) scored on each held-out part SPLITS names (default "test dev"; the same trained student, re-scored),
# its record kept in TEST_RECORDS for test and DEV_RECORDS for dev.
score_on_splits() {
  local run=$1 test_records=$2 dev_records=$3
  shift 3
  for part in ${SPLITS:-test dev}; do
    case $part in
      test) dofla "$@" $TEST_SCORE
            python -m studies.records "$run" --into "$test_records" ;;
      dev) dofla "$@"
           python -m studies.records "$run" --into "$dev_records" ;;
      *) echo "SPLITS: unknown held-out part '$part' (test, dev)" >&2
         exit 2 ;;
    esac
  done
}
