#!/usr/bin/env bash
# The original AAM (jbk708/aam) beside aamperf's levels, on one data set and one machine: README.md.
# Usage: experiments/original/run.sh   (env: REPEATS=2, OUT=outputs/original, CONFIGS="<names below>")
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/original OUT=${OUT:-outputs/original} REPEATS=${REPEATS:-2}
SRC=${AAM_SRC:-/tmp/aam-src} VENV=${AAM_VENV:-/tmp/aam-orig-venv}
ASVS=128 LAYERS=2 STEPS=10  # 100 samples: 80 train = 10 steps of 8 (one epoch of the original), 20 val

# the original in a scratch venv, never a dependency of aamperf
[ -d "$SRC" ] || { git clone https://github.com/jbk708/aam "$SRC" && git -C "$SRC" checkout 6f65d20; }
if [ ! -x "$VENV/bin/aam" ]; then
  python3 -m venv "$VENV" && "$VENV/bin/pip" install torch==2.13.0
  SETUPTOOLS_SCM_PRETEND_VERSION_FOR_AAM=0.0.0+6f65d20 "$VENV/bin/pip" install "$SRC"  # no .git: no version
fi
[ -f $OUT/data/unifrac.npy ] || .venv/bin/python $HERE/prepare.py $OUT/data 100 1000 70 1000

ORIG=(--table $OUT/data/table.biom --unifrac-matrix $OUT/data/unifrac.npy --rarefy-depth 1000
      --epochs 1 --batch-size 8 --embedding-dim 128 --attention-heads 4 --attention-layers $LAYERS
      --token-limit $ASVS --asv-sampling abundance --lr 1e-4 --warmup-steps 10 --weight-decay 0.01
      --device cpu --seed 0)
FAST=(--mixed-precision bf16 --compile-model --attn-implementation sdpa --no-gradient-checkpointing)
AP=(model=aam_base model.max_asvs=$ASVS model.asv_layers=$LAYERS model.sample_layers=$LAYERS
    model.encoder_layers=$LAYERS model.count_embedding=false data=biom data.table=$PWD/$OUT/data/table.biom
    data.unifrac=$PWD/$OUT/data/unifrac.npy data.rarefy_depth=1000 trainer.batch_size=8
    trainer.max_steps=$STEPS trainer.lr=1e-4 trainer.warmup_steps=10 trainer.weight_decay=0.01
    trainer.grad_clip=0 trainer.min_lr_ratio=0 trainer.progress=false metrics.log_every=1 seed=0)

CONFIGS=${CONFIGS:-original-default baseline original-fastest basic advanced ultra}
for rep in $(seq "$REPEATS"); do  # configurations alternate, so a slow spell of the machine hits all
  for cfg in $CONFIGS; do
    d=$OUT/runs/$rep/$cfg && rm -rf "$d" && mkdir -p "$d"
    case $cfg in
      original-default) cmd=("$VENV/bin/python" $HERE/time_original.py $d/steps.json -- "${ORIG[@]}" --output-dir $d/aam) ;;
      original-fastest) cmd=("$VENV/bin/python" $HERE/time_original.py $d/steps.json -- "${ORIG[@]}" "${FAST[@]}" --output-dir $d/aam) ;;
      *) cmd=(.venv/bin/python -m aamperf.train optim=$cfg "${AP[@]}" hydra.run.dir=$d) ;;
    esac
    echo "$rep $cfg"
    cat /proc/loadavg > $d/loadavg
    /usr/bin/time -v -o $d/time.txt "${cmd[@]}" > $d/log.txt 2>&1  # wall time and peak RSS, both alike
    cat /proc/loadavg >> $d/loadavg
  done
done
.venv/bin/python $HERE/summarize.py $OUT/runs | tee $OUT/table.md
