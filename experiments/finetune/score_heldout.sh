#!/usr/bin/env bash
# Every finished regression fine-tune of run.sh's OUT_DIR scored on the held-out samples (heldout.py), once:
# the original's with score_aam.py in its venv (RUN/heldout_predictions.tsv), aamperf's with
# `python -m aamperf.predict` (RUN/heldout/targets.tsv). Not timed: after the runs, outside their clocks.
# A run already scored, a classification, or one that did not finish is passed over.
#   experiments/finetune/score_heldout.sh OUT_DIR [RUN_PATTERN ...]   (default: every run, *_seed*)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(cd "$1" && pwd) heldout=$1/data/heldout
original=/tmp/finetune/aam/bin/python aamperf=.venv/bin/python
[[ -f $heldout/metadata.tsv ]] || { echo "no held-out samples in $heldout (run.sh HELDOUT=N writes them)"; exit 0; }
heldout=$(cd "$heldout" && pwd)
patterns=("${@:2}")
((${#patterns[@]})) || patterns=("*_seed*")
for pattern in "${patterns[@]}"; do for run in "$out"/runs/$pattern/; do
  run=${run%/}
  [[ -d $run ]] || continue
  [[ $(cat "$run/exit_code" 2>/dev/null) == 0 ]] || continue
  if [[ -f $run/record.json ]]; then  # the original's
    [[ -f $run/heldout_predictions.tsv ]] && continue
    rc=0
    $original experiments/finetune/score_aam.py "$run" "$out/data" >"$run/heldout.log" 2>&1 || rc=$?
    case $rc in
      0) echo "${run##*/}: held-out" ;;
      3) rm "$run/heldout.log" ;;  # a classification: not scored
      *) echo "${run##*/}: held-out failed: $run/heldout.log"; tail -2 "$run/heldout.log" ;;
    esac
  else
    [[ -f $run/heldout/targets.tsv ]] && continue
    grep -q '"type": "regression"' "$run/summary.json" || continue
    echo "${run##*/}: held-out"
    $aamperf -m aamperf.predict "run=$run" "data.table=$heldout/table.biom" "data.metadata=$heldout/metadata.tsv" \
      progress=false "hydra.run.dir=$run/heldout" >"$run/heldout.log" 2>&1 ||
      { echo "  failed: $run/heldout.log"; tail -2 "$run/heldout.log"; }
  fi
done; done
