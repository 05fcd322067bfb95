#!/usr/bin/env bash
# Ablation: each phase alone on the baseline, and each phase removed from ultra, at the headline
# shapes, one seed, short runs (conf/experiment/ablation.yaml). Then one comparison report.
#   bash experiments/ablation/run.sh [OUT_DIR] [extra overrides...]
#   SKIP="precision=bf16" bash experiments/ablation/run.sh ...   # rows left out (a CPU without native
#   bf16 runs a bf16 step at the headline's shapes for minutes: the probe's 0.03x fp32 matmul says so)
set -euo pipefail
out=${1:-outputs/ablation/$(date +%Y-%m-%d_%H-%M-%S)}
shift || true
common=(experiment=ablation trainer.progress=false "$@")
# a run that fails is a row of the report; a bad override (exit code 2) stops the study
run() {
  local name=$1; shift
  for skipped in ${SKIP:-}; do [[ " $* " == *" $skipped "* ]] && { echo "skipped: $name (SKIP)"; return; }; done
  python -m aamperf.train "${common[@]}" "$@" "hydra.run.dir=$out/$name" || (($? != 2))
}

run baseline optim=baseline
for phase in precision=bf16 attention=sdpa dropout=fast memory=none aam_ops=padding_aware aam_ops=dedup \
             compile=default dataloader=tuned optimizer=adamw_fused system=tuned; do
  run "alone_${phase//[=\/]/_}" optim=baseline "$phase"
done
run ultra optim=ultra
for phase in precision=fp32 attention=math dropout=standard memory=full aam_ops=plain compile=disabled \
             dataloader=simple optimizer=adamw_for_loop system=default; do
  run "ultra_without_${phase//[=\/]/_}" optim=ultra "$phase"
done
python -m aamperf.compare "$out"
