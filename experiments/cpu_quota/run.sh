#!/usr/bin/env bash
# Threads under a CPU quota. In a cgroup that grants QUOTA cores' time per period: optim=advanced with
# torch's own thread count (one per core the process sees, what a run took before; the baseline),
# with the count aamperf takes now (system.num_threads=null: the quota rounded up) and with 1 thread;
# 3 paired seeds each, one job at a time, and the report's verdicts.
#   experiments/cpu_quota/run.sh [OUT_DIR] [QUOTAS] [-- OVERRIDES]
# Needs root and a cgroup cpu controller it may write (v1's cpu hierarchy, or v2's cpu.max).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/cpu_quota/$(date +%Y-%m-%d_%H-%M-%S)}
quotas=${2:-1 1.5}
shift $(($# < 2 ? $# : 2))
[[ ${1:-} == -- ]] && shift
if [[ -e /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then parent=/sys/fs/cgroup/cpu; else parent=/sys/fs/cgroup; fi
if [[ ! -w $parent ]]; then
  echo "error: cannot make a cgroup in $parent (needs root and a writable cgroup cpu controller)" >&2
  exit 2
fi
cores=$(nproc)
lscpu | grep -E "^Model name" || true
for quota in $quotas; do
  quota_us=$(python -c "print(round($quota * 100000))")
  group=$parent/aamperf_quota_$$
  mkdir "$group"
  if [[ $parent == /sys/fs/cgroup/cpu ]]; then
    echo "$quota_us" > "$group/cpu.cfs_quota_us"
  else
    echo "$quota_us 100000" > "$group/cpu.max"
  fi
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$group" \
    python -m aamperf.train -m optim=advanced "system.num_threads=$cores,null,1" seed=0,1,2 \
    trainer.progress=false "compare.baseline=\"system.num_threads=$cores\"" "$@" \
    "hydra.sweep.dir=$out/quota_$quota"
  rmdir "$group"
done
