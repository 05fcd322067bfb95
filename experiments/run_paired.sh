#!/usr/bin/env bash
# A study as paired runs: levels x seeds on the study's data (data.seed fixed), each run in its own
# process (its time from launch includes its own start-up, as a user's run does), the levels
# alternating within each seed (a change of machine load falls on all of them), in reverse order on
# every other seed (a run right after another may be slower: the order falls on each level both ways
# round, as in seeds_in_turn.sh), then the report.
#   experiments/run_paired.sh EXPERIMENT [OUT_DIR] [LEVELS] [SEEDS] [-- extra overrides]
#   experiments/run_paired.sh convergence outputs/convergence "baseline advanced ultra" "0 1 2"
# A "level" with an '=' is an override in place of a level (the level then among the extra overrides),
# and the first of them is the report's baseline:
#   experiments/run_paired.sh headline OUT "precision.residual=fp32 precision.residual=autocast" "0 1 2" -- optim=advanced
# EXPERIMENT `default` runs the default configuration (aam_small, 100 steps), no experiment file.
set -euo pipefail
cd "$(dirname "$0")/.."
experiment=$1
out=${2:-outputs/$experiment/$(date +%Y-%m-%d_%H-%M-%S)}
levels=${3:-baseline ultra}
seeds=${4:-0 1 2}
shift $(( $# < 4 ? $# : 4 ))
study=("experiment=$experiment")
[[ $experiment == default ]] && study=()
[[ ${1:-} == -- ]] && shift
lscpu | grep -E "^Model name" || true
pass=0
for seed in $seeds; do
  read -r -a order <<<"$levels"
  if ((pass % 2)); then
    reversed=(); for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[i]}"); done; order=("${reversed[@]}")
  fi
  pass=$((pass + 1))
  for optim in "${order[@]}"; do
    choice=("optim=$optim") name=$optim
    [[ $optim == *=* ]] && choice=("$optim") name=${optim//[=.]/_}
    python -m aamperf.train "${study[@]}" "${choice[@]}" "seed=$seed" trainer.progress=false \
      "hydra.run.dir=$out/${name}_seed$seed" "$@"
  done
done
first=${levels%% *}
if [[ $first == *=* ]]; then python -m aamperf.compare "$out" --baseline "$first"; else python -m aamperf.compare "$out"; fi
