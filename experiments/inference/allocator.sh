#!/usr/bin/env bash
# predict's allocator: tcmalloc preloaded (the command starts itself again with it, the default) against
# glibc's malloc with freed blocks kept (allocator=null), a process each, in turn, REPEATS times: the
# benchmark of each level (bench.enabled=true) and the plain command that writes the files (its wall time
# and peak RSS by /usr/bin/time, the restart included).
#   experiments/inference/allocator.sh [OUT_DIR]   (env: RUN=<a completed run>, REPEATS=3, LEVELS="baseline fast")
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-outputs/inference-allocator/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$out" && lscpu > "$out/lscpu.txt"
run=${RUN:-$out/train}
[[ -n ${RUN:-} ]] || python -m aamperf.train trainer.progress=false "hydra.run.dir=$run" > "$out/train.log" 2>&1
for repeat in $(seq 1 "${REPEATS:-3}"); do
  for level in ${LEVELS:-baseline fast}; do
    for allocator in tcmalloc null; do
      for job in bench files; do
        dir=$out/$job-$level-$allocator-$repeat
        extra=()
        [[ $job == bench ]] && extra=(bench.enabled=true)
        echo "$dir"
        /usr/bin/time -v -o "$dir.time" python -m aamperf.predict "run=$run" "inference=$level" \
          "allocator=$allocator" progress=false "${extra[@]}" "hydra.run.dir=$dir" > "$dir.log" 2>&1
      done
    done
  done
done
python experiments/inference/allocator_table.py "$out" | tee "$out/table.md"
