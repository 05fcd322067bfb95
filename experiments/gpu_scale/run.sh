#!/usr/bin/env bash
# AAM at its real size on one GPU: the original AAM (jbk708/aam `aam pretrain`, default and fastest flags)
# beside aamperf's levels on the same data, paired seeds, one table (README.md beside this file).
#   experiments/gpu_scale/run.sh [OUT_DIR]        # default outputs/gpu_scale/<date>; needs an NVIDIA GPU
#   DRY=1 experiments/gpu_scale/run.sh            # the CPU dry run: tiny data and model, a few steps
# env: STEPS=200 (batch-8 runs; rounded up to whole epochs of the original), AUTO_STEPS=30 (ultra at
#   the finder's batch), SEEDS="0 1", CONFIGS (the first seed's; names below), LATER_CONFIGS (the other
#   seeds': "original-fastest ultra", the pair the issue's bar is about; also ultra-packed, ultra-ops,
#   ultra-full, ultra-budget, ultra-compiled, ultra-graphs, ultra-ops-compiled, ultra-full-compiled,
#   ultra-waited, ultra-residual: ultra at batch 8 with aam_ops=packed, memory=ops / full / budget (with
#   compile=default), compile=default, compile=reduce_overhead, memory=ops / full with compile=default,
#   trainer.overlap_steps=false, precision.residual=autocast; ultra-big: ultra at a batch of BIG=48 over
#   BIG_PASSES=2 times batch 8's samples (the time to batch 8's quality, not only the same samples),
#   validated as often in samples, the learning rate x sqrt(BIG / 8), warm-up over the same samples), TIME_LIMIT_S (no run begins
#   after it, each is stopped at it), WHEELS=.whl (experiments/gpu_scale/wheels.sh: installs without network),
#   ORIG_ATTN=sdpa (the original's --attn-implementation in its fastest flags), PROFILE_STEPS=3 (the first
#   seed's runs of PROFILED profile that many steady steps: summary.json's profile, kernels by GPU time;
#   0: none), PROFILED="ultra" (aamperf's configurations, names as in CONFIGS),
#   SNAPSHOT=1 (those runs also record 2 steps of the CUDA allocator's history: the table says what held
#   their peak, by the line that allocated it; memory_snapshot.pickle for pytorch.org/memory_viz)
# Exit: 0 every run finished; 1 one failed or was cut off (the table says which); 2 no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/gpu_scale
out=${1:-outputs/gpu_scale/$(date +%Y-%m-%d_%H-%M-%S)}
SEEDS=${SEEDS:-0 1} WHEELS=${WHEELS:-.whl} ORIG_ATTN=${ORIG_ATTN:-sdpa} PROFILE_STEPS=${PROFILE_STEPS:-3}
SNAPSHOT=${SNAPSHOT:-0} PROFILED=${PROFILED-ultra} BIG_PASSES=${BIG_PASSES:-2}
# aamperf's configurations (each one's command: the case below), spaced for whole-word matches
AAMPERF_CONFIGS=" baseline basic advanced ultra ultra-packed ultra-ops ultra-full ultra-budget ultra-compiled ultra-graphs ultra-ops-compiled ultra-full-compiled ultra-waited ultra-residual ultra-big ultra-auto "
CONFIGS=${CONFIGS:-original-fastest ultra original-default baseline advanced ultra-auto}
LATER_CONFIGS=${LATER_CONFIGS-original-fastest ultra}
for p in $PROFILED; do  # names checked before anything is written
  [[ $AAMPERF_CONFIGS == *" $p "* ]] ||
    { echo "error: PROFILED: '$p' is not one of aamperf's configurations:$AAMPERF_CONFIGS: set PROFILED to some of them, or empty" >&2; exit 2; }
done
for c in $CONFIGS $LATER_CONFIGS; do
  [[ " original-default original-fastest$AAMPERF_CONFIGS" == *" $c "* ]] ||
    { echo "error: CONFIGS / LATER_CONFIGS: unknown configuration '$c' (original-default original-fastest$AAMPERF_CONFIGS)" >&2; exit 2; }
done
[[ $BIG_PASSES =~ ^[1-9][0-9]*$ ]] ||
  { echo "error: BIG_PASSES=$BIG_PASSES must be a whole number >= 1 (ultra-big's samples, in batch 8's runs')" >&2; exit 2; }
venvs=/tmp/gpu_scale

if [[ -n ${DRY:-} ]]; then  # every path of the real run on this CPU, at toy sizes
  device=cpu base=.venv/bin/python STEPS=${STEPS:-6} AUTO_STEPS=${AUTO_STEPS:-4}
  data=(48 300 30 500 1000)  # samples, ASVs, mean richness, rarefaction depth, reads simulated
  D=32 HEADS=2 LAYERS=1 ASVS=64 BIG=${BIG:-16}
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q "GPU " ||
    { echo "error: no NVIDIA GPU here (nvidia-smi): run on a GPU machine, or DRY=1 for the CPU dry run" >&2; exit 2; }
  device=cuda base=python3 STEPS=${STEPS:-200} AUTO_STEPS=${AUTO_STEPS:-30}
  data=(400 3000 600 8000 20000)  # median 420 real ASVs per sample after rarefaction (162-952)
  D=128 HEADS=4 LAYERS=4 ASVS=1024 BIG=${BIG:-48}  # aam_base: the original's CLI defaults
fi
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)  # absolute: the runs read their data from it
start=$SECONDS

# Two venvs over the base interpreter's packages (the GPU image's python3 and its torch; here aamperf's
# .venv): the original's and aamperf's, each with only its own extra packages, from carried wheels.
make_venv() {  # DIR WHEEL_GLOBS...: a venv that sees $base's packages after its own
  local dir=$1
  shift
  [[ -x $dir/bin/python ]] && return 0
  "$base" -m venv --without-pip "$dir"
  "$base" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base-site.pth"
  (($#)) && "$base" -m pip install -q --no-index --no-deps --no-compile --prefix "$dir" "$@"
  return 0
}
shared=("$WHEELS"/biom_format-*.whl "$WHEELS"/scikit_bio-*.whl "$WHEELS"/array_api_compat-*.whl "$WHEELS"/decorator-*.whl)
if [[ $device == cpu ]]; then
  make_venv $venvs/aam "$WHEELS"/aam-*.whl  # biom-format, scikit-bio: in aamperf's .venv already
  aamperf=.venv/bin/python
else
  make_venv $venvs/aam "$WHEELS"/aam-*.whl "${shared[@]}"
  make_venv $venvs/aamperf "${shared[@]}" "$WHEELS"/hydra_core-*.whl "$WHEELS"/omegaconf-*.whl "$WHEELS"/antlr4_*.whl
  aamperf=$venvs/aamperf/bin/python
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; export PYTHONPATH  # aamperf from this checkout
fi
original=$venvs/aam/bin/python
$original -c 'import aam.cli.pretrain' || { echo "error: the original does not import in $venvs/aam: run $HERE/wheels.sh here first" >&2; exit 2; }
$aamperf -c 'import aamperf.train'

# the machine, where it measures
{ if [[ $device == cuda ]]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else lscpu | sed -n 's/^Model name: *//p'; fi
  $aamperf -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'; } >"$out/machine.txt"
cat "$out/machine.txt"

[[ -f $out/data/unifrac.npy ]] || $aamperf experiments/original/prepare.py "$out/data" "${data[@]}"
n=$(wc -l <"$out/data/unifrac.ids.txt")
# the original splits off ceil(0.2 n) for validation and drops each epoch's last partial batch: whole
# epochs of it, and aamperf's batch-8 runs take as many steps
per_epoch=$(((n - (n + 4) / 5) / 8)) epochs=$(((STEPS + per_epoch - 1) / per_epoch))
STEPS=$((epochs * per_epoch))
if [[ " $CONFIGS $LATER_CONFIGS " == *" ultra-big "* ]] && ((STEPS * 8 % BIG)); then
  echo "error: BIG=$BIG does not divide the $((STEPS * 8)) samples of $STEPS steps of 8: set BIG to a divisor of them" >&2; exit 2
fi
echo "$n samples: $STEPS steps of 8 ($epochs epochs of the original), ultra-auto $AUTO_STEPS steps"

ORIG=(--table "$out/data/table.biom" --unifrac-matrix "$out/data/unifrac.npy" --rarefy-depth "${data[3]}"
      --epochs $epochs --batch-size 8 --no-auto-batch-size --embedding-dim $D --attention-heads $HEADS
      --attention-layers $LAYERS --token-limit $ASVS --warmup-steps 10 --device $device)
FAST=(--mixed-precision bf16 --compile-model --tf32 --attn-implementation "$ORIG_ATTN" --no-gradient-checkpointing)
AP=(model=aam_base model.embedding_dim=$D model.num_heads=$HEADS model.max_asvs=$ASVS model.asv_layers=$LAYERS
    model.sample_layers=$LAYERS model.encoder_layers=$LAYERS data=biom "data.table=$out/data/table.biom"
    "data.unifrac=$out/data/unifrac.npy" "data.rarefy_depth=${data[3]}" trainer.warmup_steps=10
    trainer.grad_clip=0 trainer.min_lr_ratio=0 trainer.progress=false device=$device
    trainer.val_batch_size=8)  # every run validates in batches of 8: its val loss over the same UniFrac pairs

status=0 first=1
for seed in $SEEDS; do  # configurations alternate within each seed: a slow spell hits all of them
  cfgs=$CONFIGS
  ((first)) || cfgs=$LATER_CONFIGS
  first=0
  for cfg in $cfgs; do
    d=$out/runs/${cfg}_seed$seed
    rm -rf "$d" && mkdir -p "$d"
    case $cfg in
      original-default) cmd=($original $HERE/time_original.py "$d/steps.json" -- "${ORIG[@]}" --seed "$seed" --output-dir "$d/aam") ;;
      original-fastest) cmd=($original $HERE/time_original.py "$d/steps.json" -- "${ORIG[@]}" "${FAST[@]}" --seed "$seed" --output-dir "$d/aam") ;;
      ultra-packed | ultra-ops | ultra-full | ultra-budget | ultra-compiled | ultra-graphs \
      | ultra-ops-compiled | ultra-full-compiled | ultra-waited | ultra-residual)
        # ultra with one change of issue 41 part 2 / 4, at batch 8
        case $cfg in
          ultra-packed) change=(aam_ops=packed) ;;
          # compile=auto declined compile at 234 steps on an H200: compiled, forced, to see its steady gain;
          # the budget acts in compiled graphs only; CUDA graphs over aam_ops=fast's bucketed shapes
          ultra-compiled) change=(compile=default) ;;
          ultra-budget) change=(memory=budget compile=default) ;;
          ultra-graphs) change=(compile=reduce_overhead) ;;
          # a checkpoint wrapper compiled with the block (on torch 2.11 these fell back to eager before
          # aamperf/phases/recompute.py)
          ultra-ops-compiled) change=(memory=ops compile=default) ;;
          ultra-full-compiled) change=(memory=full compile=default) ;;
          # each step waits for its own GPU work (one host sync a step, as before trainer.overlap_steps)
          ultra-waited) change=(trainer.overlap_steps=false) ;;
          # the residual stream and LayerNorms in the autocast dtype (the profile: fp32 norms and casts ~28%
          # of the kernel time)
          ultra-residual) change=(precision.residual=autocast) ;;
          *) change=("memory=${cfg#ultra-}") ;;
        esac
        cmd=($aamperf -m aamperf.train optim=ultra "${AP[@]}" "${change[@]}" trainer.batch_size=8 trainer.max_steps=$STEPS seed=$seed "hydra.run.dir=$d") ;;
      ultra-big)  # fewer, larger steps over BIG_PASSES x the samples, validated every ~400 samples as batch 8
        # is (every 50 steps): time to batch 8's quality. Adam's square-root rule for the learning rate
        lr=$(awk "BEGIN { printf \"%.3g\", 1e-4 * sqrt($BIG / 8) }")
        cmd=($aamperf -m aamperf.train optim=ultra "${AP[@]}" trainer.batch_size=$BIG trainer.max_steps=$((BIG_PASSES * STEPS * 8 / BIG))
             trainer.val_every=$(((50 * 8 + BIG - 1) / BIG)) trainer.lr=$lr trainer.warmup_steps=$(((10 * 8 + BIG - 1) / BIG)) seed=$seed "hydra.run.dir=$d") ;;
      ultra-auto) cmd=($aamperf -m aamperf.train optim=ultra "${AP[@]}" trainer.batch_size=auto trainer.max_steps=$AUTO_STEPS seed=$seed "hydra.run.dir=$d") ;;
      baseline | basic | advanced | ultra) cmd=($aamperf -m aamperf.train optim=$cfg "${AP[@]}" trainer.batch_size=8 trainer.max_steps=$STEPS seed=$seed "hydra.run.dir=$d") ;;
    esac
    # (PROFILE_STEPS=0: no override, so every seed's run of a configuration is alike for aamperf.compare)
    if [[ " $PROFILED " == *" $cfg "* && $seed == "${SEEDS%% *}" ]] && ((PROFILE_STEPS > 0)); then cmd+=(metrics.profile_steps=$PROFILE_STEPS)
      if ((SNAPSHOT)); then cmd+=(metrics.memory_snapshot=true); fi
    fi
    limit=()
    if [[ -n ${TIME_LIMIT_S:-} ]]; then
      left=$((TIME_LIMIT_S - (SECONDS - start)))
      if ((left <= 0)); then echo 124 >"$d/exit_code"; status=1; echo "$cfg seed $seed: not begun (TIME_LIMIT_S)"; continue; fi
      limit=(timeout --kill-after=10 $left)
    fi
    echo "$cfg seed $seed"
    t0=$EPOCHREALTIME rc=0
    "${limit[@]}" "${cmd[@]}" >"$d/log.txt" 2>&1 || rc=$?
    echo "$t0 $EPOCHREALTIME" >"$d/clock_s"  # launch and exit: end to end, start-up, probes, compile included
    echo $rc >"$d/exit_code"
    ((rc == 0)) || { status=1; echo "  exit $rc: $d/log.txt"; tail -3 "$d/log.txt"; }
  done
done
$aamperf $HERE/summarize.py "$out" | tee "$out/table.md"
exit $status
