#!/usr/bin/env bash
# ASV sampling: which of a sample's ASVs the model reads when it has more than max_asvs (data.asv_sampling:
# abundance, first, random) against the target's quality, on the default data (~80 ASVs a sample, 16 read),
# paired seeds; each run's model predicting on whole sequences, on its bases hidden as training hid them
# (predict's default), and as the mean of PASSES such draws. One table (README.md beside this file).
#   experiments/asv_sampling/run.sh [OUT_DIR]   # default outputs/asv_sampling/<date>
#   DRY=1 experiments/asv_sampling/run.sh       # the dry run: tiny data, 4 steps (a minute)
# env: SEEDS="0 1 2", STEPS=400, PASSES=8, LEVEL=advanced (the optim level every run trains at)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/asv_sampling/$(date +%Y-%m-%d_%H-%M-%S)}
SEEDS=${SEEDS:-0 1 2} STEPS=${STEPS:-400} PASSES=${PASSES:-8} LEVEL=${LEVEL:-advanced}
tiny=()
if [[ -n ${DRY:-} ]]; then
  STEPS=4 PASSES=2 SEEDS="0 1"
  tiny=(model=aam_tiny data.n_samples=60 data.n_asvs=128 data.mean_richness=40 data.depth=1200 data.rarefy_depth=1000)
fi
mkdir -p "$out" && out=$(cd "$out" && pwd)
seeds=${SEEDS// /,}
python -m aamperf.train -m optim="$LEVEL" data.asv_sampling=abundance,first,random seed="$seeds" \
  trainer.max_steps="$STEPS" trainer.val_every=$((STEPS / 4 > 0 ? STEPS / 4 : 1)) trainer.val_batches=100 \
  trainer.progress=false 'compare.baseline="data.asv_sampling=abundance"' "${tiny[@]}" \
  hydra.sweep.dir="$out/sweep" > "$out/sweep.log" 2>&1
# every run's samples through its model (the paths hold '=': quoted): whole sequences (mask=none), its bases
# hidden as training hid them (predict's default, mask=run), and the mean of PASSES such draws (of hidden
# bases, and of ASVs under random)
for run in "$out"/sweep/*/; do
  name=$(basename "$run")
  for reading in "whole mask=none" "1 passes=1" "$PASSES passes=$PASSES"; do
    set -- $reading
    python -m aamperf.predict "run='$run'" "$2" progress=false "hydra.run.dir='$out/predict/$name/$1'" \
      >> "$out/predict.log" 2>&1
  done
done
python experiments/asv_sampling/summarize.py "$out" | tee "$out/table.md"
