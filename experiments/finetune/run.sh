#!/usr/bin/env bash
# Fine-tuning (AAM's stage 2): aamperf's levels beside the original AAM's `aam train` (jbk708/aam 6f65d20),
# frozen and unfrozen, a regression (`target`) and a classification (`environment`), on one data set and
# one CPU, paired seeds, one table (README.md beside this file).
#   experiments/finetune/run.sh [OUT_DIR]     # default outputs/finetune/<date>; the measurement (quiet machine)
#   DRY=1 experiments/finetune/run.sh         # the dry run: tiny data and model, 2 epochs (a few minutes)
# env: EPOCHS=5 (fine-tuning epochs, both programs; the original's survey runs 50), PRETRAIN_EPOCHS=5,
#   SEEDS="0 1" (fine-tuning seeds; each pretraining runs once, seed 0), LEVELS="baseline ultra" (aamperf's
#   fine-tunes), PRETRAIN_LEVEL=baseline (aamperf's pretraining), TARGETS="target environment",
#   FREEZES="encoder none", TARGET_HEADS="transformer" (aamperf's model.target_head: transformer, the original's;
#   linear), SAME_SPLIT=1 (aamperf validates on the original's validation samples of the same seed; 0: its own
#   split), REUSE_ORIGINAL (1: the original's fine-tunes that finished in OUT_DIR are kept, not run again),
#   TIME_LIMIT_S (no run begins after it, each is stopped at it), HELDOUT=200 (DRY: 24; samples of the same simulated
#   data set no run trains or validates on, heldout.py; each finished regression is scored on them after
#   the runs, score_heldout.sh; 0: none),
#   WHEELS=.whl (the original's wheel: experiments/gpu_scale/wheels.sh)
# Exit: 0 every run finished; 1 one failed or was cut off (the table says which); 2 the original missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/finetune
out=${1:-outputs/finetune/$(date +%Y-%m-%d_%H-%M-%S)}
SEEDS=${SEEDS:-0 1} LEVELS=${LEVELS:-baseline ultra} PRETRAIN_LEVEL=${PRETRAIN_LEVEL:-baseline}
TARGETS=${TARGETS:-target environment} FREEZES=${FREEZES:-encoder none} WHEELS=${WHEELS:-.whl}
TARGET_HEADS=${TARGET_HEADS:-transformer} SAME_SPLIT=${SAME_SPLIT:-1}
venv=/tmp/finetune/aam

if [[ -n ${DRY:-} ]]; then  # every path of the real run, at toy sizes
  EPOCHS=${EPOCHS:-2} PRETRAIN_EPOCHS=${PRETRAIN_EPOCHS:-1} HELDOUT=${HELDOUT:-24}
  data=(48 300 30 500 1000)  # samples, ASVs, mean richness, rarefaction depth, reads simulated
  D=32 HEADS=2 LAYERS=1 ASVS=64
else  # experiments/original's data and model: its measured step times size EPOCHS (README.md)
  EPOCHS=${EPOCHS:-5} PRETRAIN_EPOCHS=${PRETRAIN_EPOCHS:-5} HELDOUT=${HELDOUT:-200}
  data=(100 1000 70 1000 5000)
  D=128 HEADS=4 LAYERS=2 ASVS=128
fi
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)  # absolute: aamperf resolves relative paths from its launch directory, so both read one
start=$SECONDS

# the original in a venv of its own over aamperf's .venv (torch, biom-format, scikit-bio, scikit-learn,
# pandas): only its wheel is installed, never into aamperf's
if [[ ! -x $venv/bin/python ]]; then
  ls "$WHEELS"/aam-*.whl >/dev/null 2>&1 || { echo "error: no $WHEELS/aam-*.whl: run experiments/gpu_scale/wheels.sh first" >&2; exit 2; }
  .venv/bin/python -m venv --without-pip $venv
  .venv/bin/python -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$($venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base-site.pth"
  .venv/bin/python -m pip install -q --no-index --no-deps --no-compile --prefix $venv "$WHEELS"/aam-*.whl
fi
original=$venv/bin/python aamperf=.venv/bin/python
$original -c 'import aam.cli.train' || { echo "error: the original does not import in $venv (rm -rf $venv and run again)" >&2; exit 2; }

# the machine, named beside every figure
{ lscpu | sed -n 's/^Model name: *//p'
  echo "cores $(nproc); flags: $(grep -o -w -E 'avx512_bf16|amx_[a-z0-9]+' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')"
  $aamperf -c 'import torch; print("torch", torch.__version__)'; } >"$out/machine.txt"
cat "$out/machine.txt"

[[ -f $out/data/metadata.tsv ]] || $aamperf $HERE/prepare.py "$out/data" "${data[@]}"
((HELDOUT == 0)) || [[ -f $out/data/heldout/metadata.tsv ]] || $aamperf $HERE/heldout.py "$out/data" "$HELDOUT" "${data[@]}"
n=$(wc -l <"$out/data/unifrac.ids.txt")
# the original keeps ceil(0.2 n) for validation and drops each epoch's last partial batch: aamperf takes as
# many steps of 8 per epoch (its validation: round(0.2 n) samples, all of them, once at the end)
per_epoch=$(((n - (n + 4) / 5) / 8))
echo "$n samples: $per_epoch steps of 8 per epoch; pretraining $PRETRAIN_EPOCHS epochs, fine-tuning $EPOCHS"
echo "per_epoch=$per_epoch epochs=$EPOCHS pretrain_epochs=$PRETRAIN_EPOCHS samples=$n" >"$out/settings.txt"

ORIG=(--table "$out/data/table.biom" --unifrac-matrix "$out/data/unifrac.npy" --rarefy-depth "${data[3]}"
      --batch-size 8 --no-auto-batch-size --embedding-dim $D --attention-heads $HEADS --attention-layers $LAYERS
      --token-limit $ASVS --asv-sampling abundance --lr 1e-4 --warmup-steps 10 --weight-decay 0.01 --device cpu)
AP=(model=aam_base model.embedding_dim=$D model.num_heads=$HEADS model.max_asvs=$ASVS model.asv_layers=$LAYERS
    model.sample_layers=$LAYERS model.encoder_layers=$LAYERS model.count_embedding=false data=biom
    "data.table=$out/data/table.biom" "data.unifrac=$out/data/unifrac.npy" "data.rarefy_depth=${data[3]}"
    trainer.batch_size=8 trainer.lr=1e-4 trainer.warmup_steps=10 trainer.weight_decay=0.01 trainer.grad_clip=0
    trainer.min_lr_ratio=0 trainer.progress=false)
# stage 2: the target (the original's --loss-type mse --target-transform zscore, aamperf's defaults),
# validated once at the end on every validation sample; no early stopping in the original
ORIG_FT=(--metadata "$out/data/metadata.tsv" --loss-type mse --no-count-prediction
         --patience $((EPOCHS + 1)) --epochs $EPOCHS)
AP_FT=("data.metadata=$out/data/metadata.tsv" data.target_transform=zscore loss.target_loss=mse
       trainer.max_steps=$((EPOCHS * per_epoch)) trainer.val_every=$((EPOCHS * per_epoch)) trainer.val_batches=1000)

status=0
launch() {  # NAME COMMAND...: one run in runs/NAME, timed from launch to exit, cut off at TIME_LIMIT_S
  local d=$out/runs/$1 rc=0 limit=()
  shift
  rm -rf "$d" && mkdir -p "$d"
  if [[ -n ${TIME_LIMIT_S:-} ]]; then
    local left=$((TIME_LIMIT_S - (SECONDS - start)))
    if ((left <= 0)); then echo 124 >"$d/exit_code"; status=1; echo "${d##*/}: not begun (TIME_LIMIT_S)"; return; fi
    limit=(timeout --kill-after=10 $left)
  fi
  echo "${d##*/}"
  cat /proc/loadavg >"$d/loadavg"
  local t0=$EPOCHREALTIME
  "${limit[@]}" "$@" >"$d/log.txt" 2>&1 || rc=$?
  echo "$t0 $EPOCHREALTIME" >"$d/clock_s"  # launch and exit: end to end, start-up and data loading included
  cat /proc/loadavg >>"$d/loadavg"
  echo $rc >"$d/exit_code"
  ((rc == 0)) || { status=1; echo "  exit $rc: $d/log.txt"; tail -3 "$d/log.txt"; }
}
run_dir() { echo "$out/runs/$1"; }

# stage 1, once per program (seed 0)
pre_orig=$(run_dir pretrain-original) pre_ap=$(run_dir pretrain-aamperf)
[[ $(cat "$pre_orig/exit_code" 2>/dev/null) == 0 ]] ||
  launch pretrain-original $original $HERE/time_aam.py "$pre_orig/record.json" pretrain -- "${ORIG[@]}" \
    --epochs $PRETRAIN_EPOCHS --seed 0 --output-dir "$pre_orig/aam"
[[ $(cat "$pre_ap/exit_code" 2>/dev/null) == 0 ]] ||
  launch pretrain-aamperf $aamperf -m aamperf.train optim=$PRETRAIN_LEVEL "${AP[@]}" data.target=null \
    trainer.max_steps=$((PRETRAIN_EPOCHS * per_epoch)) trainer.val_every=$((PRETRAIN_EPOCHS * per_epoch)) \
    trainer.val_batches=1000 seed=0 "hydra.run.dir=$pre_ap"

# stage 2: each seed, target and freeze; the programs alternate within them, so a slow spell hits all
for seed in $SEEDS; do
  for target in $TARGETS; do
    for freeze in $FREEZES; do
      case $freeze in
        encoder) frozen=frozen orig_freeze=(--freeze-base --penalty 0 --nuc-penalty 0)  # the target's loss alone
          ap_freeze=(finetune.freeze=encoder loss.unifrac_weight=0 loss.nucleotide_weight=0) ;;
        none) frozen=unfrozen orig_freeze=() ap_freeze=(finetune.freeze=none) ;;  # + UniFrac + nucleotide, 1 each
        *) echo "error: FREEZES: unknown '$freeze' (encoder none)" >&2; exit 2 ;;
      esac
      case $target in  # the original's classifier: class indices in a column of their own, untransformed
        environment) classes=$(cut -f2 "$out/data/metadata.tsv" | tail -n +2 | sort -u | wc -l)
          orig_target=(--metadata-column environment_id --classifier --out-dim "$classes" --target-transform none) ;;
        *) orig_target=(--metadata-column "$target" --target-transform zscore) ;;
      esac
      name=${target}-${frozen}
      d=$(run_dir "$name-original_seed$seed")
      if [[ -n ${REUSE_ORIGINAL:-} && $(cat "$d/exit_code" 2>/dev/null) == 0 ]]; then
        echo "${d##*/}: kept (REUSE_ORIGINAL)"
      elif [[ $(cat "$pre_orig/exit_code") == 0 ]]; then
        launch "$name-original_seed$seed" $original $HERE/time_aam.py "$d/record.json" train -- "${ORIG[@]}" \
          "${ORIG_FT[@]}" "${orig_target[@]}" "${orig_freeze[@]}" --pretrained-encoder "$pre_orig/aam/pretrained_encoder.pt" \
          --seed "$seed" --output-dir "$d/aam"
      fi
      # the original's validation samples of this seed (its split follows --seed), where its run wrote them
      split=()
      if ((SAME_SPLIT)) && [[ -f $d/aam/val_samples.txt ]]; then split=("data.val_samples=$d/aam/val_samples.txt"); fi
      for level in $LEVELS; do
        for head in $TARGET_HEADS; do
          [[ $(cat "$pre_ap/exit_code") == 0 ]] || continue
          program=$level && [[ $head == linear ]] || program=$level-$head  # runs/<target>-<frozen>-<program>_seed<seed>
          launch "$name-$program""_seed$seed" $aamperf -m aamperf.train optim=$level "${AP[@]}" "${AP_FT[@]}" \
            "data.target=$target" "${ap_freeze[@]}" "init.from_run=$pre_ap" seed="$seed" "${split[@]}" \
            model.target_head=$head model.target_layers=$LAYERS "hydra.run.dir=$(run_dir "$name-$program""_seed$seed")"
        done
      done
    done
  done
done
$HERE/score_heldout.sh "$out"
$aamperf $HERE/summarize.py "$out" | tee "$out/table.md"
exit $status
