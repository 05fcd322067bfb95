#!/usr/bin/env bash
# Compile variants at the headline shapes (optim=advanced, one seed): eager, each transformer block compiled
# (regional, the default), the whole model, and each with dynamic shapes; then one comparison against eager.
#   bash experiments/compile/run.sh [OUT_DIR] [SEED]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/compile/$(date +%Y-%m-%d_%H-%M-%S)}
seed=${2:-0}
lscpu | grep -E "^Model name" || true
run() { local name=$1; shift; python -m aamperf.train experiment=headline optim=advanced "seed=$seed" \
  trainer.progress=false "$@" "hydra.run.dir=$out/$name" || true; }
run eager compile=disabled
run regional compile=default compile.per_block=true
run whole compile=default compile.per_block=false
run regional_dynamic compile=default compile.per_block=true compile.dynamic=true
run whole_dynamic compile=default compile.per_block=false compile.dynamic=true
python -m aamperf.compare "$out" --baseline compile=disabled
