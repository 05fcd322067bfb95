#!/usr/bin/env bash
# The data_scale study: time to first step, peak RSS and samples/s against the number of samples n, for
# batch UniFrac (data.unifrac_mode=batch) and the precomputed matrix (scikit-bio, up front). Each data
# set is simulated first, in a process of its own (not part of any run's start-up); then each run
# twice on a cache of its own: cold (the sample store, or the matrix, built) and warm (both served from
# the cache), alternating modes so a change of machine load falls on both.
#   experiments/data_scale/run.sh [OUT_DIR]
#   BATCH_NS="1000 10000 100000" PRECOMPUTED_NS="1000 2000 4000" experiments/data_scale/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/data_scale/$(date +%Y-%m-%d_%H-%M-%S)}
batch_ns=${BATCH_NS:-1000 10000 100000}
precomputed_ns=${PRECOMPUTED_NS:-1000 2000 4000}
cache=$out/cache
lscpu | grep -E "^Model name" || true
common=(model=aam_tiny trainer.batch_size=16 trainer.max_steps=20 trainer.val_every=1000 trainer.progress=false
  metrics.rf_baseline=false  # the random forest grows faster than the samples: not this study's question
  "data.cache_dir=$cache")
run() {  # mode n cold|warm
  python -m aamperf.train "${common[@]}" "data.n_samples=$2" "data.unifrac_mode=$1" \
    "hydra.run.dir=$out/$1_n$2_$3"
}
for n in $(printf '%s\n' $batch_ns $precomputed_ns | sort -nu); do
  python - "$n" "$cache" <<'PY'
import sys, time
from pathlib import Path
from aamperf.config import DataConfig
from aamperf.data.simulate import SimParams, ensure_simulated
d = DataConfig()
start = time.perf_counter()
params = SimParams(int(sys.argv[1]), d.n_asvs, d.n_envs, d.mean_richness, d.depth, d.seed)
ensure_simulated(params, Path(sys.argv[2]))
print(f"simulated n={params.n_samples} in {time.perf_counter() - start:.1f} s")
PY
  for temp in cold warm; do
    [[ " $batch_ns " == *" $n "* ]] && run batch "$n" "$temp"
    [[ " $precomputed_ns " == *" $n "* ]] && run precomputed "$n" "$temp"
  done
done
du -sh "$cache"/samples "$cache"/unifrac 2>/dev/null || true
python experiments/data_scale/summarize.py "$out" | tee "$out/data_scale.md"
