#!/usr/bin/env bash
# Activation checkpointing: peak memory vs step time for none / selective / full / ops at the headline
# shapes with optim=advanced (its auto choices for the device), then the batch sizes that fit a cap.
#   bash experiments/checkpointing/run.sh [OUT_DIR]
set -euo pipefail
out=${1:-outputs/checkpointing/$(date +%Y-%m-%d_%H-%M-%S)}
common=(experiment=checkpointing trainer.progress=false)

# 1. the four modes, same batch, 3 paired seeds, each run its own process (a sweep's jobs share one, and
# the heap one job grew is the next one's: their peaks would not be their own); the report in $out/modes
mkdir -p "$out" && out=$(cd "$out" && pwd)
"$(dirname "$0")/../run_paired.sh" checkpointing "$out/modes" "memory=none memory=selective memory=full memory=ops" "0 1 2"

# 2. growing batches, with and without full checkpointing: peak memory per batch size. A run may fail
# (out of memory) and the study goes on; a bad override (exit code 2) stops it.
for memory in none full; do
  for batch in 8 16 32 64; do
    python -m aamperf.train "${common[@]}" memory=$memory trainer.batch_size=$batch trainer.max_steps=4 \
      metrics.skip_steps=1 "hydra.run.dir=$out/batches/${memory}_b$batch" || (($? != 2))  # 2: a config error
  done
done
