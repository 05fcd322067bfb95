#!/usr/bin/env bash
# The inference study: a default run trained (aam_small, 100 steps; or RUN=<a completed run's directory>),
# then the inference levels benchmarked on its samples, twice (a change of machine load shows as the
# spread between the two sweeps), each ending in comparison.{json,md,png}.
#   experiments/inference/run.sh [OUT_DIR]
#   DEVICE=cuda experiments/inference/run.sh [OUT_DIR]   # training and benchmarks on that device (default: auto)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/inference/$(date +%Y-%m-%d_%H-%M-%S)}
device=(${DEVICE:+"device=$DEVICE"})
lscpu | grep -E "^Model name" || true
run=${RUN:-$out/train}
[[ -n ${RUN:-} ]] || python -m aamperf.train trainer.progress=false "${device[@]}" "hydra.run.dir=$run"
for sweep in 1 2; do
  python -m aamperf.predict -m "run=$run" inference=baseline,fast,int8 bench.enabled=true progress=false \
    "${device[@]}" "hydra.sweep.dir=$out/bench$sweep"
done
