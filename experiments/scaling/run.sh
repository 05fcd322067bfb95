#!/usr/bin/env bash
# Scaling on this machine: 1 vs 2 ranks (DDP over gloo, 1 thread per rank) at the headline shapes with
# optim=advanced. Strong scaling: the same global batch (8) on 2 ranks. Weak scaling: the same batch per
# rank (8), so 16 on 2 ranks; every run validated in batches of 8. Then the gradient all-reduce alone, timed
# at the model's size.
#   bash experiments/scaling/run.sh [OUT_DIR]
set -euo pipefail
out=${1:-outputs/scaling/$(date +%Y-%m-%d_%H-%M-%S)}
common=(experiment=headline optim=advanced system.num_threads=1 trainer.max_steps=10 trainer.val_every=10
        trainer.val_batch_size=8 metrics.skip_steps=2 trainer.progress=false)
torchrun=(torchrun --standalone --nproc_per_node=2 -m aamperf.train)
for seed in 0 1 2; do
  python -m aamperf.train "${common[@]}" distributed=none trainer.batch_size=8 seed=$seed "hydra.run.dir=$out/1rank_b8_s$seed"
  python -m aamperf.train "${common[@]}" distributed=none trainer.batch_size=16 seed=$seed "hydra.run.dir=$out/1rank_b16_s$seed"
  "${torchrun[@]}" "${common[@]}" distributed=ddp trainer.batch_size=8 seed=$seed "hydra.run.dir=$out/2ranks_b8_s$seed"
  "${torchrun[@]}" "${common[@]}" distributed=ddp trainer.batch_size=16 seed=$seed "hydra.run.dir=$out/2ranks_b16_s$seed"
done
python -m aamperf.compare "$out" --baseline "distributed=none trainer.batch_size=8"
torchrun --standalone --nproc_per_node=2 "$(dirname "$0")/allreduce.py" "$out/1rank_b8_s0/summary.json"
