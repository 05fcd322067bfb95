#!/usr/bin/env bash
# Ablation: each phase alone on the baseline, and each phase removed from ultra, at the headline
# shapes, short runs (conf/experiment/ablation.yaml), paired seeds. Then one comparison report.
#   bash experiments/ablation/run.sh [OUT_DIR] [extra overrides...]
#   SEEDS="0 1 2" (default): each seed runs every row, in reverse order on every other seed, so a drift of
#   the machine's speed during the study falls on the rows both ways round
#   SKIP="precision=bf16" bash experiments/ablation/run.sh ...   # rows left out (a CPU without native
#   bf16 runs a bf16 step at the headline's shapes for minutes: the probe's 0.03x fp32 matmul says so)
set -euo pipefail
source "$(dirname "$0")/../seeds_in_turn.sh"
out=${1:-outputs/ablation/$(date +%Y-%m-%d_%H-%M-%S)}
shift || true
common=(experiment=ablation trainer.progress=false "$@")

rows=("baseline optim=baseline")
for phase in precision=bf16 attention=sdpa dropout=fast memory=none aam_ops=padding_aware aam_ops=dedup \
             aam_ops=fast compile=default dataloader=tuned optimizer=adamw_fused system=tuned; do
  rows+=("alone_${phase//[=\/]/_} optim=baseline $phase")
done
rows+=("ultra optim=ultra")
for phase in precision=fp32 attention=math dropout=standard memory=full aam_ops=plain compile=disabled \
             dataloader=simple optimizer=adamw_for_loop system=default; do
  rows+=("ultra_without_${phase//[=\/]/_} optim=ultra $phase")
done

# a run that fails is a row of the report; a bad override (exit code 2) stops the study
run() {
  local name=$1 seed=$2; shift 2
  for skipped in ${SKIP:-}; do [[ " $* " == *" $skipped "* ]] && { echo "skipped: $name (SKIP)"; return; }; done
  python -m aamperf.train "${common[@]}" "$@" "seed=$seed" "hydra.run.dir=$out/${name}_seed$seed" || (($? != 2))
}

lscpu | grep -E "^Model name" || true
seeds_in_turn run
python -m aamperf.compare "$out"
