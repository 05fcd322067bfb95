#!/usr/bin/env bash
# The memory study: for each level, one run at the headline batch (peak RSS, process tree PSS) and one
# batch-size finder run under a fixed budget (the largest batch that fits), each in its own process.
#   experiments/memory/run.sh [OUT_DIR] [LEVELS] [BUDGET_GIB] [-- OVERRIDES]
# OVERRIDES go to every run (e.g. precision=fp32: the levels as a CPU without fast bf16 runs them).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/memory/$(date +%Y-%m-%d_%H-%M-%S)}
levels=${2:-baseline basic advanced ultra}
budget=${3:-2.5}
shift $(($# < 3 ? $# : 3))
[[ ${1:-} == -- ]] && shift
lscpu | grep -E "^Model name" || true
for optim in $levels; do
  python -m aamperf.train experiment=memory "optim=$optim" trainer.progress=false "$@" "hydra.run.dir=$out/${optim}_batch8"
  python -m aamperf.train experiment=memory "optim=$optim" trainer.progress=false trainer.batch_size=auto \
    "trainer.auto_batch.budget_gib=$budget" trainer.auto_batch.max_batch=128 trainer.max_steps=3 \
    metrics.skip_steps=1 "$@" "hydra.run.dir=$out/${optim}_largest"
done
python experiments/memory/summarize.py "$out" > "$out/memory.md"
cat "$out/memory.md"
