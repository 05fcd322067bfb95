#!/usr/bin/env bash
# Compile variants at the headline shapes (optim=advanced): eager, each transformer block compiled
# (regional, the default), the whole model, and each with dynamic shapes; paired seeds, each run its own
# process with a new inductor cache (every run pays its first compile, as a user's first run on a machine
# does), the variants in reverse order on every other seed; then one comparison against eager.
#   bash experiments/compile/run.sh [OUT_DIR]
#   SEEDS="0 1 2" (default)
set -euo pipefail
source "$(dirname "$0")/../seeds_in_turn.sh"
cd "$(dirname "$0")/../.."
out=${1:-outputs/compile/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$out" && out=$(cd "$out" && pwd)
rows=("eager compile=disabled"
      "regional compile=default compile.per_block=true"
      "whole compile=default compile.per_block=false"
      "regional_dynamic compile=default compile.per_block=true compile.dynamic=true"
      "whole_dynamic compile=default compile.per_block=false compile.dynamic=true")
run() {
  local name=$1 seed=$2; shift 2
  TORCHINDUCTOR_CACHE_DIR="$out/inductor_cache/${name}_seed$seed" python -m aamperf.train experiment=headline \
    optim=advanced "seed=$seed" trainer.progress=false "$@" "hydra.run.dir=$out/${name}_seed$seed" || (($? != 2))
}
lscpu | grep -E "^Model name" || true
seeds_in_turn run
rm -rf "$out/inductor_cache"
python -m aamperf.compare "$out" --baseline compile=disabled
