#!/usr/bin/env bash
# The wheels a GPU machine without network needs for experiments/gpu_scale/run.sh, into .whl/ (ignored:
# `echo /.whl/ >> .git/info/exclude`; the device call names it in `carry`). Run here, with network.
# The GPU image's python3 (3.12: torch, numpy, scipy, pandas, h5py, scikit-learn, statsmodels, click,
# tqdm, tensorboard, matplotlib, psutil, nvidia-ml-py, pyyaml: /work/.library/device/KINDS.md) has the
# rest. run.sh installs these with --no-deps: what aamperf's run and the original import, and no more
# (wandb, a dependency of aamperf that these runs never import, stays behind).
#   experiments/gpu_scale/wheels.sh        # AAM_SRC=<the original's source> (default /tmp/aam-src)
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=${AAM_SRC:-/tmp/aam-src} W=.whl
[ -f "$SRC/pyproject.toml" ] || { echo "error: no original source in $SRC: set AAM_SRC (jbk708/aam at 6f65d20)" >&2; exit 2; }
mkdir -p $W
# the original, a wheel of its fetched source (no .git: setuptools_scm is told its version)
ls $W/aam-*.whl >/dev/null 2>&1 ||
  SETUPTOOLS_SCM_PRETEND_VERSION_FOR_AAM=0.0.0+6f65d20 python3 -m pip wheel -q --no-deps -w $W "$SRC"
platforms=()
for n in 28 27 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# hydra (aamperf), biom-format and scikit-bio (both programs) and their needs the image lacks
python3 -m pip download -q -d $W --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" hydra-core==1.3.2 omegaconf==2.3.0 biom-format==2.1.18 scikit-bio==0.7.4 \
  array-api-compat==1.16.0 decorator==5.3.1
python3 -m pip wheel -q --no-deps -w $W antlr4-python3-runtime==4.9.3  # published as a source archive
du -sh $W
