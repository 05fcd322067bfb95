#!/usr/bin/env bash
# Exact large batches against batch 8 (README.md beside this file): each configuration x seed in its own
# process (its time from launch includes its start-up), the configurations alternating within each seed,
# then the report (python -m aamperf.compare, batch 8 the baseline).
#   experiments/exact_batch/run.sh [OUT_DIR] [SEEDS]       # default outputs/exact_batch/<date>, "0 1 2"
#   CONFIGS="b8 b32-lr-x2 b32-exact-lr-x2" experiments/exact_batch/run.sh OUT   # some configurations only
# Every run validates every ~200 samples on the whole validation set; each sees 3,200 samples but the x2 ones:
#   b8            batch 8, 400 steps, warm-up 20, validation every 25 steps (the convergence study's run)
#   b32-exact     batch 32 as 4 micro-batches of 8 (gradient caching: UniFrac over all 32 x 31 pairs, the
#                 memory of batch 8), 100 steps, warm-up 5, validation every 6 steps
#   b32-exact-lr  the same at twice the learning rate (2e-4: the square-root rule for 4x the batch, Adam)
#   b32-lr        batch 32 in one pass at 2e-4: the same pairs and gradients as b32-exact-lr (dropout apart),
#                 4x the activations of batch 8: what filling the device with a larger batch gives
#   b32-lr-x2, b32-exact-lr-x2   b32-lr and b32-exact-lr over twice the samples (200 steps, the schedule
#                 over them): whether they reach batch 8's final quality sooner given the samples to get there
# Every run validates in batches of 8 (conf/experiment/exact_batch.yaml: trainer.val_batch_size), so the
# UniFrac part of each val loss is over the same pairs.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/exact_batch/$(date +%Y-%m-%d_%H-%M-%S)}
seeds=${2:-0 1 2}
configs=${CONFIGS:-b8 b32-exact b32-exact-lr b32-lr}
b32() {  # batch 32 for $1 steps: warm-up and validation as often in samples as batch 8's
  echo "trainer.batch_size=32 trainer.max_steps=$1 trainer.warmup_steps=5 trainer.val_every=6 metrics.log_every=6"
}
declare -A CONFIG=(
  [b8]="trainer.batch_size=8"
  [b32-exact]="$(b32 100) trainer.grad_accum_steps=4"
  [b32-exact-lr]="$(b32 100) trainer.grad_accum_steps=4 trainer.lr=2e-4"
  [b32-lr]="$(b32 100) trainer.lr=2e-4"
  [b32-exact-lr-x2]="$(b32 200) trainer.grad_accum_steps=4 trainer.lr=2e-4"
  [b32-lr-x2]="$(b32 200) trainer.lr=2e-4"
)
for name in $configs; do
  [[ -n ${CONFIG[$name]+x} ]] || { echo "error: CONFIGS: unknown configuration '$name' (${!CONFIG[*]})" >&2; exit 2; }
done
lscpu | grep -E "^Model name" || true
for seed in $seeds; do
  for name in $configs; do
    # shellcheck disable=SC2086  # the configuration's overrides, one word each
    python -m aamperf.train experiment=exact_batch ${CONFIG[$name]} "seed=$seed" trainer.progress=false \
      "hydra.run.dir=$out/${name}_seed$seed"
  done
done
python -m aamperf.compare "$out" --baseline trainer.batch_size=8
