"""experiments/in_turn.py: the two ways of each pair give the same loss (what makes a time ratio the whole
comparison), and the script still builds a level's job as aamperf does."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "in_turn.py"


# every pair in `pytest -m slow`: 5-10 s each on a 2-core AMX Xeon (a process, the level's probes; asv-masks
# 7 s on a quiet machine, 20-40 s on a busy one). What asv-masks times is checked in process by the default
# suite (tests/model/test_packed.py):
# test_asv_encoder_without_masks_gives_the_masked_outputs_on_full_length_asvs
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "pair",
    [
        pytest.param("asv-masks", marks=SLOW),
        pytest.param("mask-threads", marks=SLOW),
        pytest.param("chunk-bytes", marks=SLOW),
        pytest.param("mask-cast", marks=SLOW),
        pytest.param("pad-keys", marks=SLOW),
    ],
)
def test_each_pair_trains_the_same_and_prints_its_ratio(pair, cache_dir):
    args = [sys.executable, str(SCRIPT), pair, "2", "model=aam_tiny", f"data.cache_dir={cache_dir}"]
    if pair in ("chunk-bytes", "pad-keys"):  # the chunked dropout attention: attention=sdpa on a CPU
        args.append("attention=sdpa")
    if pair in ("mask-cast", "pad-keys"):  # a 2-byte dtype's multiplier, its softmax rows
        args.append("precision=bf16")
    env = {**os.environ, "CHUNK_MIB": "0.05"}  # chunk-bytes: chunks of one row against CHUNK_BYTES' many
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (float(v) for v in re.search(r"losses: \S+ (\S+), \S+ (\S+)", proc.stdout).groups())
    # pad-keys rounds a few attention weights the other way in bf16
    assert first == pytest.approx(second, rel=1e-3 if pair == "pad-keys" else 1e-5)
    assert re.search(r"time over .*: median \d+\.\d+, range \d+\.\d+-\d+\.\d+ over 2 pairs", proc.stdout)
