"""attention=auto's probe timing every round against stopping once its rounds clear the choice's margin
(`bounds`, aamperf.probe_measures.beyond): the seconds each probe takes, its SDPA / math ratio and its
rounds, the two alternated in one process. The figures behind docs/levels.md's attention=auto paragraph.

Usage: LD_PRELOAD=libtcmalloc_minimal.so.4 python experiments/headline/attention_probe_rounds.py \
       ROWS,HEADS,L,HEAD_DIM [fp32|bf16] [REPEATS=4]
The headline's shape is 256,4,151,32, the default job's 128,2,151,24; dropout 0.1 with the fused masks, as
optim=advanced and ultra train; the margin is training's (MIN_MATH_GAIN).
"""

import sys
import time

import torch

from aamperf.metrics.host import cpu_description
from aamperf.phases.auto import MIN_MATH_GAIN
from aamperf.probe_measures import measure_attention


def main() -> None:
    shape = tuple(int(v) for v in sys.argv[1].split(","))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[2] if len(sys.argv) > 2 else "fp32"]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = {"every round": [], f"bounds ({MIN_MATH_GAIN},)": []}
    for _ in range(repeats):
        for name, bounds in zip(rows, [(), (MIN_MATH_GAIN,)], strict=True):
            start = time.perf_counter()
            r = measure_attention(torch.device("cpu"), dtype, shape, True, (0.1, "fast"), bounds)
            rows[name].append((time.perf_counter() - start, r["sdpa_s"] / r["math_s"], r["rounds"]))
    for name, probes in rows.items():
        seconds, ratios, rounds = zip(*probes, strict=True)
        print(
            f"{list(shape)} {dtype}, {name}: seconds {[round(s, 2) for s in seconds]}, "
            f"SDPA / math {[round(r, 3) for r in ratios]}, rounds {list(rounds)}"
        )


if __name__ == "__main__":
    main()
