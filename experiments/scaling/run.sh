#!/usr/bin/env bash
# Scaling on this machine: 1 vs 2 ranks (DDP over gloo, 1 thread per rank) at the headline shapes with
# optim=advanced. Strong scaling: the same global batch (8) on 2 ranks. Weak scaling: the same batch per
# rank (8), so 16 on 2 ranks. Beside them one process with every core's thread (torch's default), what a
# user of this machine would run without ranks. Every run validated in batches of 8. Then the gradient
# all-reduce alone, timed at the model's size.
#   bash experiments/scaling/run.sh [OUT_DIR]
set -euo pipefail
out=${1:-outputs/scaling/$(date +%Y-%m-%d_%H-%M-%S)}
common=(experiment=headline optim=advanced trainer.max_steps=10 trainer.val_every=10 trainer.val_batch_size=8
        metrics.skip_steps=2 trainer.progress=false)
one=(python -m aamperf.train "${common[@]}" distributed=none)
torchrun=(torchrun --standalone --nproc_per_node=2 -m aamperf.train "${common[@]}" distributed=ddp system.num_threads=1)
for seed in 0 1 2; do
  "${one[@]}" system.num_threads=1 trainer.batch_size=8 seed=$seed "hydra.run.dir=$out/1rank_b8_s$seed"
  "${one[@]}" system.num_threads=1 trainer.batch_size=16 seed=$seed "hydra.run.dir=$out/1rank_b16_s$seed"
  "${torchrun[@]}" trainer.batch_size=8 seed=$seed "hydra.run.dir=$out/2ranks_b8_s$seed"
  "${torchrun[@]}" trainer.batch_size=16 seed=$seed "hydra.run.dir=$out/2ranks_b16_s$seed"
  "${one[@]}" trainer.batch_size=8 seed=$seed "hydra.run.dir=$out/1rank_b8_all_threads_s$seed"
done
python -m aamperf.compare "$out" --baseline "distributed=none system.num_threads=1 trainer.batch_size=8"
torchrun --standalone --nproc_per_node=2 "$(dirname "$0")/allreduce.py" "$out/1rank_b8_s0/summary.json"
