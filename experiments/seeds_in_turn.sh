# Sourced by a study's run.sh: every row (a name, then its overrides) for each seed of SEEDS (default
# "0 1 2"), the rows in reverse order on every other seed, so a drift of the machine's speed during the study
# falls on the rows both ways round. The study defines `rows` and a function that runs one row:
#   rows=("eager compile=disabled" ...); run() { local name=$1 seed=$2; shift 2; ...; }; seeds_in_turn run
seeds_in_turn() {
  local run_row=$1 pass=0 seed row i
  local -a order words
  for seed in ${SEEDS:-0 1 2}; do
    order=("${rows[@]}")
    if ((pass % 2)); then order=(); for ((i = ${#rows[@]} - 1; i >= 0; i--)); do order+=("${rows[i]}"); done; fi
    for row in "${order[@]}"; do
      read -r -a words <<<"$row"
      "$run_row" "${words[0]}" "$seed" "${words[@]:1}"
    done
    pass=$((pass + 1))
  done
}
