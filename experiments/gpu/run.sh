#!/usr/bin/env bash
# The GPU check (experiments/gpu/README.md), one command on a fresh machine with an NVIDIA GPU: installs
# aamperf into .venv-gpu, then runs on the GPU the GPU test suite, the headline study as paired runs, the
# precision sweep and the inference study, and writes one table of them all: OUT_DIR/summary.md (+ .json).
#   experiments/gpu/run.sh [OUT_DIR]                       # default outputs/gpu/<date>
#   WHEELS=<dir> experiments/gpu/run.sh [OUT_DIR]          # offline: every package from <dir>'s wheels
#   TORCH_INDEX_URL=<PyTorch index> experiments/gpu/run.sh # another torch build than the driver's
#   EXTRAS= experiments/gpu/run.sh                         # aamperf without its extras (default: [dev])
#   DRY_RUN=1 experiments/gpu/run.sh                       # say what it would install; install nothing
#   STEPS="gpu_tests headline" experiments/gpu/run.sh      # these steps only (default: all four)
#   TIME_LIMIT_S=480 experiments/gpu/run.sh                # a lent machine: stop every step at 480 s from
#                                                          # the start (exit code 124 in steps.tsv)
#   GPU_TEST_ARGS="-n 4" experiments/gpu/run.sh            # more pytest arguments (-n: pytest-xdist)
# Exit: 0 all passed; 1 the GPU suite or a study failed (the summary says which); 2 no GPU, or no torch
# for it.
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "error: $*" >&2; exit 2; }

# No GPU: one line and nothing written (no venv, no output directory).
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: run this on a machine with an NVIDIA GPU and its driver"
gpus=$(nvidia-smi -L 2>&1) || true
[[ $gpus == *"GPU "* ]] || die "nvidia-smi sees no GPU: ${gpus%%$'\n'*}"
command -v python3 >/dev/null || die "python3 not found: install Python >= 3.11"
out=${1:-outputs/gpu/$(date +%Y-%m-%d_%H-%M-%S)}

# The CUDA version the driver supports (nvidia-smi's header), e.g. 12.8; empty if it does not say.
smi=$(nvidia-smi 2>&1) || true
driver_cuda=
[[ $smi =~ CUDA\ Version:\ *([0-9]+\.[0-9]+) ]] && driver_cuda=${BASH_REMATCH[1]}

# torch's CUDA build for this driver: the newest PyTorch build the driver runs. A driver runs builds of
# its own CUDA version and older ones; a CUDA 12 driver also runs the newer 12.x builds (CUDA's minor
# version compatibility), so 12.0-12.7 take cu126. Driver CUDA -> index (download.pytorch.org/whl/...):
#   >= 13.0 -> cu130;  12.8, 12.9 -> cu128;  12.0 - 12.7 -> cu126;  older: set TORCH_INDEX_URL.
torch_index() {
  [[ -n $driver_cuda ]] ||
    die "cannot read the driver's CUDA version from nvidia-smi; set TORCH_INDEX_URL=https://download.pytorch.org/whl/cu<NNN>"
  local major=${driver_cuda%.*} minor=${driver_cuda#*.} build
  if ((major >= 13)); then build=cu130
  elif ((major == 12 && minor >= 8)); then build=cu128
  elif ((major == 12)); then build=cu126
  else die "the driver supports CUDA $driver_cuda, older than any torch build here (12.x); update the driver or set TORCH_INDEX_URL"
  fi
  echo "https://download.pytorch.org/whl/$build"
}

sees_gpu() { "$1" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }
has_aamperf() { "$1" -c 'import aamperf' >/dev/null 2>&1; }

# What it will install, decided and said before anything is.
venv_args=()
if [[ -x .venv-gpu/bin/python ]]; then
  echo "venv: .venv-gpu, kept"
elif sees_gpu python3; then
  venv_args=(--system-site-packages)
  echo "venv: .venv-gpu with --system-site-packages: python3's torch sees the GPU and is reused"
else
  echo "venv: .venv-gpu, a plain one"
fi
python=python3
[[ -x .venv-gpu/bin/python ]] && python=.venv-gpu/bin/python
index=
installed=
if [[ $python != python3 ]] && sees_gpu "$python" && has_aamperf "$python"; then
  installed=1
  echo "torch and aamperf: already in .venv-gpu, nothing to install"
elif sees_gpu "$python"; then
  echo "torch: $("$python" -c 'import torch; print(torch.__version__)'), already there"
elif [[ -n ${WHEELS:-} ]]; then
  echo "torch: from $WHEELS"
else
  index=${TORCH_INDEX_URL:-$(torch_index)}
  echo "torch: pip install torch --index-url $index"
fi
# EXTRAS: aamperf's extras to install (default dev: pytest, ruff and every optional part); EXTRAS= for
# the base alone, where pytest and tensorboard (tests/ imports it to collect) are already there
extras=${EXTRAS-dev}
package=.${extras:+[$extras]}
if [[ -n $installed ]]; then
  :
elif [[ -n ${WHEELS:-} ]]; then
  echo "aamperf: pip install --no-index --find-links $WHEELS -e $package (offline)"
else
  echo "aamperf: pip install -e $package"
fi
[[ -z ${DRY_RUN:-} ]] || exit 0

mkdir -p "$out"
start=$SECONDS
if [[ ! -x .venv-gpu/bin/python ]]; then
  if ! python3 -m venv "${venv_args[@]}" .venv-gpu; then
    rm -rf .venv-gpu  # half made: no pip in it
    die "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
  fi
  # python3 may itself be a venv's (the GPU images' /opt/.../.venv, a conda env): --system-site-packages
  # then reaches its base interpreter's packages, not its torch; a .pth adds python3's own, after ours
  if ((${#venv_args[@]})); then
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
      >"$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/python3-site.pth"
  fi
fi
export VIRTUAL_ENV=$PWD/.venv-gpu PATH=$PWD/.venv-gpu/bin:$PATH
if [[ -n $installed ]]; then
  :
elif [[ -n ${WHEELS:-} ]]; then
  python -m pip install --no-index --find-links "$WHEELS" -e "$package"
else
  # --force-reinstall: a kept venv's torch that sees no GPU would otherwise count as installed
  [[ -z $index ]] || python -m pip install --force-reinstall torch --index-url "$index"
  python -m pip install -e "$package"
fi
if ! sees_gpu python; then
  torch=$(python -c 'import torch; print(torch.__version__)')
  fix="set TORCH_INDEX_URL to a torch build for this driver (CUDA ${driver_cuda:-?})"
  [[ -z ${WHEELS:-} ]] || fix="carry a torch build for this driver (CUDA ${driver_cuda:-?}) in WHEELS and remove .venv-gpu"
  die "torch $torch in .venv-gpu sees no GPU; $fix"
fi
python -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}")'
printf 'install\t0\t%s\n' $((SECONDS - start)) >"$out/steps.tsv"
# the machine described where it measures (machine.json), before a study can be cut off
python experiments/gpu/summarize.py "$out" >/dev/null || echo "warning: machine.json not written (summarize.py failed)"

# Each step's output to the terminal and OUT_DIR/<step>.log, its exit code and seconds to steps.tsv; a
# failed step does not stop the next one.
# STEPS picks steps; TIME_LIMIT_S stops each at that many seconds from the start (timeout's 124), and a
# step not begun by then is recorded as 124 in 0 s.
status=0
steps=" ${STEPS:-gpu_tests headline precision inference} "
limit=()
step() {
  local name=$1 start=$SECONDS rc=0
  shift
  [[ $steps == *" $name "* ]] || return 0
  if [[ -n ${TIME_LIMIT_S:-} ]]; then
    local left=$((TIME_LIMIT_S - SECONDS))
    if ((left <= 0)); then
      echo "== $name: not begun, TIME_LIMIT_S=$TIME_LIMIT_S reached"
      printf '%s\t124\t0\n' "$name" >>"$out/steps.tsv"
      status=1
      return 0
    fi
    limit=(timeout --kill-after=10 "$left")
  fi
  echo "== $name: $*"
  "${limit[@]}" "$@" 2>&1 | tee "$out/$name.log" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - start)) >>"$out/steps.tsv"
  ((rc == 0)) || status=1
}
# shellcheck disable=SC2086  # GPU_TEST_ARGS: several words
step gpu_tests python -m pytest -m gpu -p no:cacheprovider tests --junitxml="$out/gpu_tests.xml" ${GPU_TEST_ARGS:-}
step headline experiments/run_paired.sh headline "$out/headline" "baseline basic advanced ultra" "0 1 2" -- device=cuda
step precision python -m aamperf.train -m experiment=precision device=cuda trainer.progress=false \
  "hydra.sweep.dir=$out/precision"
step inference env DEVICE=cuda experiments/inference/run.sh "$out/inference"
if python experiments/gpu/summarize.py "$out"; then
  cat "$out/summary.md"
  echo "summary: $out/summary.md, $out/summary.json"
else
  status=1
fi
exit $status
