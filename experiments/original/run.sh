#!/usr/bin/env bash
# The original AAM (jbk708/aam) beside aamperf's levels, on one data set and one machine, paired by seed:
# README.md. Usage: experiments/original/run.sh   (env: SEEDS="0 1 2", OUT=outputs/original, CONFIGS="<names below>")
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/original OUT=${OUT:-outputs/original} SEEDS=${SEEDS:-0 1 2}
SRC=${AAM_SRC:-/tmp/aam-src} VENV=${AAM_VENV:-/tmp/aam-orig-venv}
for s in $SEEDS; do  # before anything is written: a seed is the original's --seed and aamperf's seed=
  [[ $s =~ ^[0-9]+$ ]] || { echo "error: SEEDS='$SEEDS': each seed a whole number >= 0 (SEEDS=\"0 1 2\")" >&2; exit 2; }
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the runs read their data from anywhere
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
      --device cpu)
FAST=(--mixed-precision bf16 --compile-model --attn-implementation sdpa --no-gradient-checkpointing)
AP=(model=aam_base model.max_asvs=$ASVS model.asv_layers=$LAYERS model.sample_layers=$LAYERS
    model.encoder_layers=$LAYERS model.count_embedding=false data=biom data.table=$OUT/data/table.biom
    data.unifrac=$OUT/data/unifrac.npy data.rarefy_depth=1000 trainer.batch_size=8
    trainer.max_steps=$STEPS trainer.lr=1e-4 trainer.warmup_steps=10 trainer.weight_decay=0.01
    trainer.grad_clip=0 trainer.min_lr_ratio=0 trainer.progress=false metrics.log_every=1
    trainer.val_batches=100)  # as the original: every full batch of 8 of the val samples, in the table's order

# the original as its users could also run it: tcmalloc preloaded, as aamperf's tuned levels do (no flag
# of its CLI; LD_PRELOAD and the settings of aamperf/allocator.py)
TCMALLOC=(env LD_PRELOAD=libtcmalloc_minimal.so.4 TCMALLOC_RELEASE_RATE=0 TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=$((1 << 40)))
CONFIGS=${CONFIGS:-original-default baseline original-fastest basic advanced ultra original-default-tcmalloc original-fastest-tcmalloc}
for seed in $SEEDS; do  # configurations alternate within a seed, so a slow spell of the machine hits all
  mkdir -p $OUT/runs/seed$seed
  # the original's split of this seed (its pretrain: scikit-learn's train_test_split(ids, test_size=0.2,
  # random_state=seed)), validated on by both programs
  split=$OUT/runs/seed$seed/val_samples.txt
  "$VENV/bin/python" -c "import sys, biom; from sklearn.model_selection import train_test_split as s
ids = list(biom.load_table(sys.argv[1]).ids(axis='sample'))
open(sys.argv[3], 'w').write('\n'.join(s(ids, test_size=0.2, random_state=int(sys.argv[2]))[1]) + '\n')" \
    $OUT/data/table.biom "$seed" "$split"
  for cfg in $CONFIGS; do
    d=$OUT/runs/seed$seed/$cfg
    if grep -qs "Exit status: 0" "$d/time.txt"; then  # a finished run is kept: delete its directory to redo it
      echo "seed $seed: $cfg kept ($d)"; continue
    fi
    rm -rf "$d" && mkdir -p "$d"  # an unfinished one starts again
    timed=("$VENV/bin/python" experiments/gpu_scale/time_original.py $d/steps.json -- "${ORIG[@]}" --seed "$seed")
    case $cfg in
      original-default) cmd=("${timed[@]}" --output-dir $d/aam) ;;
      original-fastest) cmd=("${timed[@]}" "${FAST[@]}" --output-dir $d/aam) ;;
      original-default-tcmalloc) cmd=("${TCMALLOC[@]}" "${timed[@]}" --output-dir $d/aam) ;;
      original-fastest-tcmalloc) cmd=("${TCMALLOC[@]}" "${timed[@]}" "${FAST[@]}" --output-dir $d/aam) ;;
      *-tcmalloc) cmd=(.venv/bin/python -m aamperf.train optim=${cfg%-tcmalloc} system.allocator=tcmalloc
                       "${AP[@]}" seed=$seed "data.val_samples=$split" hydra.run.dir=$d) ;;  # a level on it
      *) cmd=(.venv/bin/python -m aamperf.train optim=$cfg "${AP[@]}" seed=$seed "data.val_samples=$split"
              hydra.run.dir=$d) ;;
    esac
    echo "seed $seed: $cfg"
    cat /proc/loadavg > $d/loadavg
    # wall time and peak RSS, both alike; aamperf starts cold (its probes, sample store), as a first run
    AAMPERF_CACHE=$d/cache /usr/bin/time -v -o $d/time.txt "${cmd[@]}" > $d/log.txt 2>&1
    cat /proc/loadavg >> $d/loadavg
    if [[ $cfg == original-* ]] && ! cmp -s <(sort "$split") <(sort $d/aam/val_sample_ids.txt); then
      echo "error: $cfg validated on other samples than $split" >&2; exit 1
    fi
  done
done
lscpu > $OUT/lscpu.txt
.venv/bin/python $HERE/summarize.py $OUT | tee $OUT/table.md
