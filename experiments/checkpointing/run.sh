#!/usr/bin/env bash
# Activation checkpointing: peak memory vs step time for none / selective / full / ops at the headline
# shapes with optim=advanced (its auto choices for the device), then the batch sizes that fit a cap.
#   bash experiments/checkpointing/run.sh [OUT_DIR]
set -euo pipefail
out=${1:-outputs/checkpointing/$(date +%Y-%m-%d_%H-%M-%S)}
common=(experiment=checkpointing trainer.progress=false)

# 1. the three modes, same batch: a sweep (conf/experiment/checkpointing.yaml) whose report lands in $out/modes
python -m aamperf.train -m "${common[@]}" "hydra.sweep.dir=$out/modes"

# 2. growing batches, with and without full checkpointing: peak memory per batch size. A run may fail
# (out of memory) and the study goes on; a bad override (exit code 2) stops it.
for memory in none full; do
  for batch in 8 16 32 64; do
    python -m aamperf.train "${common[@]}" memory=$memory trainer.batch_size=$batch trainer.max_steps=4 \
      metrics.skip_steps=1 "hydra.run.dir=$out/batches/${memory}_b$batch" || (($? != 2))  # 2: a config error
  done
done
