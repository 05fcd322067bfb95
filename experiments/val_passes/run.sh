#!/usr/bin/env bash
# Validation passes (trainer.val_passes): how much one validation's target figures depend on the draw it reads
# (data.asv_sampling=random: which ASVs; the default loss: which bases are hidden), and how much less the mean
# of several passes does. Trains the default job with random ASV draws (the original AAM's
# --val-prediction-passes setting), then measures each run's model over DRAWS draws of its validation samples.
#   experiments/val_passes/run.sh [OUT_DIR]   # default outputs/val_passes/<date>
#   DRY=1 experiments/val_passes/run.sh       # the dry run: tiny data, 4 steps (a minute)
# env: SEEDS="0 1 2", STEPS=200, DRAWS=16, LEVEL=advanced
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/val_passes/$(date +%Y-%m-%d_%H-%M-%S)}
SEEDS=${SEEDS:-0 1 2} STEPS=${STEPS:-200} DRAWS=${DRAWS:-16} LEVEL=${LEVEL:-advanced}
tiny=()
if [[ -n ${DRY:-} ]]; then
  STEPS=4 DRAWS=8 SEEDS="0 1"
  tiny=(model=aam_tiny data.n_samples=60 data.n_asvs=128 data.mean_richness=40 data.depth=1200 data.rarefy_depth=1000)
fi
mkdir -p "$out" && out=$(cd "$out" && pwd)
python -m aamperf.train -m optim="$LEVEL" data.asv_sampling=random seed="${SEEDS// /,}" \
  trainer.max_steps="$STEPS" trainer.val_every="$STEPS" trainer.progress=false "${tiny[@]}" \
  hydra.sweep.dir="$out/sweep" > "$out/sweep.log" 2>&1
python experiments/val_passes/measure.py --draws "$DRAWS" "$out"/sweep/*/ | tee "$out/table.md"
